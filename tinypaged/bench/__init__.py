"""`tinypaged bench`: offline throughput and latency, load on a server, named model shapes."""
