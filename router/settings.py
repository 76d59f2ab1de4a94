"""The routing policies (one registry) and the ``router`` section of the cluster config."""

from __future__ import annotations

from dataclasses import dataclass

from rayturn.registry import Registry
from rayturn.settings import check_above, check_at_least, check_choice

# Policy name -> the import path of its Serve ``RequestRouter`` class (Serve imports it in each routing process).
ROUTERS: Registry[str] = Registry("routing policy")
ROUTERS.register("kv_aware", lambda: "rayturn.router.request_router.KVAwareRequestRouter")
ROUTERS.register("round_robin", lambda: "rayturn.router.request_router.RoundRobinRequestRouter")


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The ``router`` section: the routing policy and its weights, and when a call goes to the prefill pool."""

    policy: str = "kv_aware"
    kv_overlap_weight: float = 1.0
    load_weight: float = 1.0
    affinity_weight: float = 0.5
    disaggregation_threshold_tokens: int = 512
    # A long prompt is computed by its decode replica instead when the replica's remote prefills still waiting
    # hold more tokens than its own (``rayturn.decode.remote_prefill``); false: the prefill pool always gets it.
    balance_prefill: bool = True
    stats_period_s: float = 1.0

    def __post_init__(self) -> None:
        check_choice("policy", self.policy, ROUTERS)
        check_at_least("kv_overlap_weight", self.kv_overlap_weight, 0)
        check_at_least("load_weight", self.load_weight, 0)
        check_at_least("affinity_weight", self.affinity_weight, 0)
        check_at_least("disaggregation_threshold_tokens", self.disaggregation_threshold_tokens, 0)
        check_above("stats_period_s", self.stats_period_s, 0)
