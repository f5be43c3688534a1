"""The metadata plane's data structures: fixed-width block ids and numpy tables (no Ray here).

Everything that says *which block is where* holds blocks as 64-bit ids in numpy arrays, updated
and queried in vectorized batches: the index shards, the change feed, every view and every
pool's block table. Full keys live only in the pools, next to the bytes, so an id collision can
never serve another block's bytes (the pool compares the full key and answers "not found").
"""
