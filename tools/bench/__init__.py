"""`brigade bench ...`: the benchmarks, their workloads, load generators and reports."""
