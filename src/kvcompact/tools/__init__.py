"""The tools around the plugin: the ``kvcompact`` command (serve, bench, doctor, plan, calibrate, prepare), the
in-process engine the tests and benchmarks share, and the accuracy harness. The plugin never imports them."""
