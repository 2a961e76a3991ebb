"""The `prefixgate` command line: the gateway, the workers and the benchmarks behind one entry point."""
