"""kvmanager: the bookkeeping of paged KV caches, served as ``kvserve.v1.KVManager``.

Domain modules (no grpc, no torch): ``hashing`` (prefix hashes), ``block_pool``
(blocks, refcounts, the free LRU queue, the prefix cache), ``events`` (KV events
and their fan-out), ``pool`` (sequences, Allocate/Fork/Free on one pool),
``sessions`` (leases) and ``manager`` (several pools + sessions + validation).
``service`` converts protobuf ⇄ domain; ``python -m kvmanager`` runs the server.
"""
