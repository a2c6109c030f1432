"""``llmtrain benchmark``: tokens/s, step time, MFU against this machine's measured matmul peak, data wait.

One module per job: :mod:`.command` (the subcommand, and the record it writes), :mod:`.training` (the recipe run
it times), :mod:`.data_timing` (the proxy that times the loop's wait for data), :mod:`.timing` (step-time
statistics from the run's metrics), :mod:`.machine` (the device, its matmul peak, threads, commit),
:mod:`.baseline` (the stored reference numbers, ``baseline.json`` here, shipped as package data) and
:mod:`.table` (the printed summary).
"""
