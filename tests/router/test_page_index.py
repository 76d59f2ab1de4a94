"""PageIndex: every replica's resident prefix in one walk, exactly as the per-replica walk finds it."""

from __future__ import annotations

import random

from rayturn.router.page_index import PageIndex
from rayturn.router.replica_stats import ReplicaStats
from rayturn.router.scoring import resident_prefix_pages

PAGES = [f"{i:016x}" for i in range(8)]


def stats(replica_id: str, device: list[str] = [], host: list[str] = []) -> ReplicaStats:  # noqa: B006
    return ReplicaStats(
        replica_id=replica_id,
        queued_prompt_tokens=0,
        running_seqs=0,
        max_num_seqs=8,
        free_pages=100,
        total_pages=100,
        cached_page_hashes=frozenset(device),
        host_page_hashes=frozenset(host),
    )


def index_of(*reports: ReplicaStats) -> PageIndex:
    index = PageIndex()
    for report in reports:
        index.update(report.replica_id, report)
    return index


def test_each_replica_gets_its_own_prefix_split_by_tier() -> None:
    index = index_of(
        stats("full", device=PAGES),
        stats("half", device=PAGES[:4]),
        stats("gap", device=PAGES[:2] + PAGES[3:]),
        stats("tiered", device=PAGES[:1] + PAGES[3:5], host=PAGES[1:3] + PAGES[4:6]),
        stats("none", device=PAGES[1:]),
    )
    assert index.resident_prefixes(PAGES, ["full", "half", "gap", "tiered", "none", "unknown"]) == {
        "full": (8, 0),
        "half": (4, 0),
        "gap": (2, 0),
        # A page in both tiers counts on the device; the walk ends at the first page in neither.
        "tiered": (3, 3),
        "none": (0, 0),
        "unknown": (0, 0),
    }


def test_only_the_candidates_asked_for_are_answered() -> None:
    index = index_of(stats("a", device=PAGES), stats("b", device=PAGES[:3]))
    assert index.resident_prefixes(PAGES, ["b"]) == {"b": (3, 0)}
    assert index.resident_prefixes([], ["a", "b"]) == {"a": (0, 0), "b": (0, 0)}


def test_a_new_report_replaces_the_old_one_and_a_removed_replicas_bit_is_reused() -> None:
    index = index_of(stats("a", device=PAGES), stats("b", device=PAGES[:2]))
    index.update("a", stats("a", device=PAGES[:1]))
    assert index.resident_prefixes(PAGES, ["a", "b"]) == {"a": (1, 0), "b": (2, 0)}
    index.update("a", None)
    assert index.resident_prefixes(PAGES, ["a", "b"]) == {"a": (0, 0), "b": (2, 0)}
    index.remove("b")
    assert "b" not in index
    index.update("c", stats("c", device=PAGES[:5]))  # takes b's bit: b's pages must not show up as c's
    assert index.resident_prefixes(PAGES, ["a", "b", "c"]) == {"a": (0, 0), "b": (0, 0), "c": (5, 0)}
    index.remove("c")
    index.update("d", stats("d"))
    assert index.resident_prefixes(PAGES, ["d"]) == {"d": (0, 0)}


def test_it_agrees_with_the_walk_over_each_replicas_stats() -> None:
    rng = random.Random(3)
    keys = [f"{i:016x}" for i in range(40)]
    for _ in range(200):
        reports = []
        for r in range(rng.randint(1, 12)):
            held = keys[: rng.randint(0, 40)]
            device = [k for k in held if rng.random() < 0.9]
            host = [k for k in keys if rng.random() < 0.2]
            reports.append(stats(f"r{r}", device=device, host=host))
        index = index_of(*reports)
        prompt = keys[: rng.randint(0, 40)]
        expected = {report.replica_id: resident_prefix_pages(prompt, report) for report in reports}
        assert index.resident_prefixes(prompt, [report.replica_id for report in reports]) == expected
