"""`llmd bench`: latency and throughput of the offline engine, and serving benchmarks
against a running daemon (see docs/benchmarks.md). Commands are in `cli`, one module
per benchmark beside it; reports are msgspec Structs (`--json` prints one)."""
