"""Realise a ``ParallelPlan`` on PyTorch's own distributed stack: the runtime layer, below validators and the app.

Modules, in the order ``parallelize`` applies them:

* ``mesh``: named DeviceMesh (pp, dp_replicate, dp_shard, cp, tp) plus the expert view (ep).
* ``model_parts``: roles of modules found by structure and data flow (no names, no model types).
* ``pipeline``: stage split + ``torch.distributed.pipelining`` schedules (1F1B, interleaved, ...).
* ``tensor_parallel``: ``parallelize_module`` plans (colwise/rowwise, SP, vocab-parallel, GQA).
* ``expert_parallel``: experts sharded over ``ep``, all-to-all dispatch and combine.
* ``adapted``: adapt's kernel plan on each chunk (kernels on local shards under TP), blocks compiled
  in place, async TP where torch provides it.
* activation checkpointing (full or selective recompute per block) is ``operators.recompute``'s, shared with
  the single-device adapted model.
* ``data_parallel``: FSDP2 ``fully_shard`` per block and root; ZeRO-1/2/3, bf16 mixed precision, offload.
* ``context_parallel``: PyTorch's ring-attention context manager (CUDA only).
* ``trainer`` / ``data``: AdamW, clipping, warm-up + cosine, metrics; synthetic or token-file data.
* ``checkpoint``: DCP save/load across layouts, HF safetensors export.
* ``runner``: the entry used by ``adapt train`` (the torchrun command line is the planner's ``parallel_planner.launch``).
"""
