"""Configuration of Zephyrine, a made-up architecture used to test adapt on code it has never seen."""

from transformers import PretrainedConfig


class ZephyrineConfig(PretrainedConfig):
    model_type = "zephyrine"

    def __init__(
        self,
        vocab_size=256,
        width=64,
        depth=2,
        n_heads=4,
        n_groups=2,
        expansion=2,
        context=256,
        epsilon=1e-5,
        quench_scale=0.5,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.width = width
        self.depth = depth
        self.n_heads = n_heads
        self.n_groups = n_groups
        self.expansion = expansion
        self.context = context
        self.epsilon = epsilon
        self.quench_scale = quench_scale
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
