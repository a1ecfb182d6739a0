"""End-to-end benchmarks of streamapp (issue 6): ceilings, the product, the seeds' comparison.

``python -m bench run --profile cpu`` (``make bench``) measures, on one machine in one run:

1. ceilings: the engine alone at the chosen batch size, plain aiokafka produce + consume of the
   same payloads, and a Faust agent that only forwards;
2. the product: saturation throughput and open-loop latency at fractions of it, batch sizes,
   CPU (and GPU) utilisation;
3. synchronous vs asynchronous vs dynamic batching, end to end;
4. the ratios of issue 6, printed last;

plus the worker's RSS while it works through a backlog. Everything benchmark-only lives here;
nothing in ``streamapp`` or ``engines`` imports it.
"""
