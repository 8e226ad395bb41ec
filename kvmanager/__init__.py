"""kvmanager: the bookkeeping of paged KV caches, served as ``kvserve.v1.KVManager``.

Domain modules (no grpc, no torch): ``hashing`` (prefix hashes), ``block_pool``
(blocks, refcounts, the free LRU queue, the prefix cache), ``events`` (KV events,
their per-pool ids, replay buffer and fan-out), ``pool`` (sequences,
Allocate/Fork/Free on one pool, prefix lookups, snapshots), ``sessions`` (leases)
and ``manager`` (several pools + sessions + validation). ``service`` converts
protobuf ⇄ domain; ``zmq_events`` publishes the KV events in vLLM's ZeroMQ format
(optional: pyzmq, msgspec); ``python -m kvmanager`` runs the server.
"""
