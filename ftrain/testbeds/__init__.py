"""Test beds for tests and benchmarks, never used by a run: S3 and GCS servers on loopback
(`local_storage`) and a multi-host test bed of network namespaces with link cuts, brown-outs,
freezes and kills (`network_testbed`). Import nothing of the project."""
