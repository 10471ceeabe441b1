"""After conversion: the command line, export/load, the runtime, serving, tuning, profiling, boards over RPC."""
