"""``adapt run``: intake → operators → plan → environment → alignment → generation → throughput → soak → report.

Import what you use from the module that defines it, so that the path from a flag to the stage reading it
is a chain of direct imports (and a command importing the options tree does not load the runner)::

    from adapt.app.pipeline.options import RunOptions
    from adapt.app.pipeline.runner import run_pipeline

    outcome = run_pipeline(RunOptions.from_dict({"source": "examples/tiny-llama", "out_dir": "runs/tiny-llama"}))
    outcome.exit_code, outcome.report["status"], outcome.records["alignment"].summary
"""
