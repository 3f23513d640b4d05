"""PrefixAffinityRouter: Ray Serve's request router with the dp router's cache-aware policy.

The ingress calls the engine replicas through a DeploymentHandle; Serve asks this router which
replica takes each call. Like dp/router.py, it hashes the prompt's first blocks (the same
`prefix_hashes`) and remembers which replica last took each hash, so a request goes to the
replica whose prefix cache most likely holds its prompt, unless that replica's queue is
`imbalance` requests longer than the shortest one; otherwise it goes to the replica with the
shortest queue (what Serve last heard from each; ties taken in turn). The other replicas follow
as a second rank, which Serve tries when the first is full (max_ongoing_requests). A replica
that dies is forgotten at once.

One router per handle: with several ingress replicas each keeps its own table (the affinity is
then per ingress replica, still right for most requests).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from tinypaged.dp.router import MAX_ENTRIES, prefix_hashes


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, block_size: int = 16, imbalance: int = 16, **_) -> None:
        self.block_size = block_size
        self.imbalance = imbalance
        self.owner: OrderedDict[int, object] = OrderedDict()  # prefix hash -> ReplicaID
        self.cache_hits = 0
        self.turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        def queue(r: RunningReplica) -> int:
            return self.replica_queue_len_cache.get(r.replica_id) or 0

        ranked = sorted(candidate_replicas, key=queue)
        if not ranked:
            return []
        chosen = None
        if pending_request is not None and pending_request.args:
            by_id = {r.replica_id: r for r in candidate_replicas}
            for h in reversed(prefix_hashes(pending_request.args[0], self.block_size)):
                owner = by_id.get(self.owner.get(h))
                if owner is not None:
                    if queue(owner) - queue(ranked[0]) <= self.imbalance:
                        self.cache_hits += 1
                        chosen = owner
                    break
        if chosen is None:  # the least loaded, ties taken in turn
            tied = [r for r in ranked if queue(r) == queue(ranked[0])]
            chosen = tied[next(self.turn) % len(tied)]
        return [[chosen], [r for r in ranked if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        if not pending_request.args:
            return
        for h in prefix_hashes(pending_request.args[0], self.block_size):
            self.owner[h] = replica_id
            self.owner.move_to_end(h)
        while len(self.owner) > MAX_ENTRIES:
            self.owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        for h in [h for h, r in self.owner.items() if r == replica_id]:
            del self.owner[h]
