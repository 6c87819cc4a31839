"""The benchmarks of ``kvcompact bench NAME``: one file per benchmark, loaded by path
(:func:`kvcompact.tools.bench.load_benchmark`); installed with the wheel as ``kvcompact.bench``."""
