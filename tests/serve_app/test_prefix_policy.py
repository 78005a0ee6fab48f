"""The prefix router's pure core: affinity, load, the guards against hot spots, staleness, determinism."""

from __future__ import annotations

from engine.core.block_hash import hash_block_chain, short_hash
from serve_app.routing.prefix_policy import PrefixRouterConfig, PrefixRouterPolicy, ReplicaLoad

BS = 16


def prompt(tenant: int, question: int, prefix_blocks: int = 20) -> list[int]:
    tokens = [1000 + tenant] * (prefix_blocks * BS) + [5000 + question] * (2 * BS)
    return hash_block_chain(tokens, BS)


def holding(hashes: list[int], n: int) -> frozenset[int]:
    return frozenset(short_hash(h) for h in hashes[:n])


def replicas(**overrides) -> list[ReplicaLoad]:
    base = {rid: ReplicaLoad(rid) for rid in ("a", "b", "c")}
    base.update(overrides)
    return list(base.values())


def test_longest_prefix_from_block_zero_wins():
    h = prompt(1, 1)
    loads = replicas(
        a=ReplicaLoad("a", cached_blocks=holding(h, 5)),
        b=ReplicaLoad("b", cached_blocks=holding(h, 20)),
        c=ReplicaLoad("c", cached_blocks=frozenset(short_hash(x) for x in h[1:22])),  # no block 0: no match
    )
    d = PrefixRouterPolicy().route(h, loads, now=0.0)
    assert d.ranked[0] == "b" and d.matched_blocks == 20 and d.reason == "prefix" and d.source == "precise"
    assert d.ranked.index("a") < d.ranked.index("c")


def test_load_trades_against_affinity_and_a_hot_prefix_spills():
    h = prompt(1, 1, prefix_blocks=4)  # a short prefix: 64 cached tokens are worth little
    busy = ReplicaLoad("a", num_waiting=3, cached_blocks=holding(h, 4))
    d = PrefixRouterPolicy().route(h, replicas(a=busy), now=0.0)
    assert d.ranked[0] != "a" and d.reason == "spill"
    long = prompt(1, 1, prefix_blocks=200)  # 3200 cached tokens outweigh three waiting requests
    d = PrefixRouterPolicy().route(long, replicas(a=ReplicaLoad("a", num_waiting=3, cached_blocks=holding(long, 200))),
                                   0.0)
    assert d.ranked[0] == "a"


def test_cache_miss_balances_load_then_hashes_consistently():
    policy = PrefixRouterPolicy()
    loads = replicas(a=ReplicaLoad("a", num_waiting=2), b=ReplicaLoad("b", num_running=1))
    d = policy.route(prompt(7, 1), loads, 0.0)
    assert d.ranked[0] == "c" and d.reason == "load" and d.matched_blocks == 0  # the least loaded, not a
    # Equal loads: rendezvous hashing on the first block spreads tenants but is the same everywhere.
    even = replicas()
    picks = {PrefixRouterPolicy().route(prompt(t, 1), even, 0.0).ranked[0] for t in range(30)}
    assert picks == {"a", "b", "c"}
    for t in range(30):
        first = PrefixRouterPolicy().route(prompt(t, 1), even, 0.0).ranked
        assert PrefixRouterPolicy().route(prompt(t, 2), list(reversed(even)), 0.0).ranked == first


def test_approximate_record_when_no_precise_stats():
    policy = PrefixRouterPolicy()
    h = prompt(3, 1)
    first = policy.route(h, replicas(), now=0.0)
    policy.record(h, first.ranked[0], now=0.0)
    again = policy.route(prompt(3, 2), replicas(), now=1.0)
    assert again.ranked[0] == first.ranked[0] and again.source == "approximate" and again.matched_blocks == 20
    stale = policy.route(prompt(3, 2), replicas(), now=10_000.0)  # aged out
    assert stale.matched_blocks == 0


def test_fresh_reports_beat_router_memory_and_stale_ones_do_not():
    policy = PrefixRouterPolicy(PrefixRouterConfig(max_stats_age_s=5))
    h = prompt(4, 1)
    policy.record(h, "a", now=0.0)  # the router once sent it to a...
    policy.complete("a")
    reported_by_b = ReplicaLoad("b", cached_blocks=holding(h, 20), stats_age_s=1.0)  # ...but b holds it
    a_says_nothing = ReplicaLoad("a", cached_blocks=frozenset(), stats_age_s=1.0)
    d = policy.route(h, replicas(a=a_says_nothing, b=reported_by_b), now=100.0)
    assert d.ranked[0] == "b" and d.source == "precise"
    old = ReplicaLoad("b", cached_blocks=holding(h, 20), stats_age_s=60.0)  # too old to trust
    d = policy.route(h, replicas(a=ReplicaLoad("a"), b=old), now=100.0)
    assert d.matched_blocks == 22 and d.ranked[0] == "a" and d.source == "approximate"


def test_routings_newer_than_a_report_extend_it():
    policy = PrefixRouterPolicy()
    h = prompt(5, 1)
    policy.record(h, "c", now=99.5)  # after c's report, which cannot show it yet
    c = ReplicaLoad("c", cached_blocks=frozenset(), stats_age_s=1.0)
    assert policy.route(h, replicas(c=c), now=100.0).ranked[0] == "c"


def test_requests_in_flight_count_as_held_though_a_report_cannot_show_them():
    policy = PrefixRouterPolicy()
    h = prompt(5, 1)
    policy.record(h, "c", now=98.0)  # before c's report, but not computed by then: the report misses it
    c = ReplicaLoad("c", cached_blocks=frozenset(), stats_age_s=1.0)
    d = policy.route(prompt(5, 2), replicas(c=c), now=100.0)
    assert d.ranked[0] == "c" and d.matched_blocks == 20 and d.source == "precise"
    policy.complete("c")  # finished: from now on only c's reports say what it holds
    assert policy.route(prompt(5, 2), replicas(c=c), now=100.0).matched_blocks == 0


def test_short_prompts_skip_affinity_and_nearly_full_caches_are_avoided():
    policy = PrefixRouterPolicy(PrefixRouterConfig(min_prefix_blocks=2))
    short = hash_block_chain([9] * BS, BS)  # one block
    loads = replicas(a=ReplicaLoad("a", cached_blocks=holding(short, 1), num_running=8))
    d = policy.route(short, loads, 0.0)
    assert d.reason == "short_prompt" and d.ranked[-1] == "a"
    h = prompt(6, 1)
    full = ReplicaLoad("a", kv_cache_usage=0.97, cached_blocks=holding(h, 2))
    assert policy.route(h, replicas(a=full), 0.0).ranked[-1] == "a"  # it would store 20 blocks there
    hit = ReplicaLoad("a", kv_cache_usage=0.97, cached_blocks=holding(h, 20), num_running=8)
    assert policy.route(h, replicas(a=hit), 0.0).ranked[0] == "a"  # but only 2 for a full hit


def test_empty_and_forgotten_replicas():
    policy = PrefixRouterPolicy()
    assert policy.route(prompt(1, 1), [], 0.0).ranked == []
    h = prompt(8, 1)
    policy.record(h, "a", 0.0)
    policy.forget_replica("a")
    assert policy.route(h, replicas(), 1.0).matched_blocks == 0


def test_approximate_record_is_bounded_per_replica():
    policy = PrefixRouterPolicy(PrefixRouterConfig(approx_capacity_blocks=50))
    for t in range(20):
        policy.record(prompt(t, 1), "a", now=float(t))
    assert len(policy._approx.lru["a"]) <= 50
    assert policy.route(prompt(19, 1), replicas(), 20.0).matched_blocks == 22  # the newest survive
    assert policy.route(prompt(0, 1), replicas(), 20.0).matched_blocks == 0


def test_a_burst_before_the_next_report_does_not_pile_onto_one_replica():
    policy = PrefixRouterPolicy()
    reported = [ReplicaLoad(rid, cached_blocks=frozenset(), stats_age_s=0.5) for rid in ("a", "b", "c")]
    chosen = []
    for q in range(12):  # one tenant's burst inside one stats period
        h = prompt(1, q, prefix_blocks=4)
        d = policy.route(h, reported, now=100.0)
        policy.record(h, d.ranked[0], now=100.0)
        chosen.append(d.ranked[0])
    assert len(set(chosen)) == 3  # the in-flight ones made the first holder look busy: it spilled
    assert chosen.count(chosen[0]) >= 4  # but affinity still kept most with the first
    for rid in chosen:
        policy.complete(rid)
    assert all(not v for v in policy._in_flight.values())


def test_per_replica_matches_and_load_only_routing_for_a_decode_pool():
    h = prompt(2, 1)
    loads = replicas(a=ReplicaLoad("a", cached_blocks=holding(h, 20), num_running=3),
                     b=ReplicaLoad("b", cached_blocks=holding(h, 6)), c=ReplicaLoad("c", kv_cache_usage=0.97))
    d = PrefixRouterPolicy().route(h, loads, now=0.0)
    assert d.matched_by_replica == {"a": 20, "b": 6, "c": 0}
    decode = PrefixRouterPolicy(PrefixRouterConfig(affinity=False)).route(h, loads, now=0.0)
    # Load and KV usage alone: b (idle, room) before a (busy, though it holds the prefix) before c (KV full).
    assert decode.ranked == ["b", "a", "c"] and decode.reason == "load" and decode.matched_blocks == 0


def test_lora_adapter_holders_win_then_longest_prefix_among_them():
    policy = PrefixRouterPolicy(PrefixRouterConfig(block_size=BS))
    hashes = hash_block_chain(list(range(BS * 4)), BS, lora_digest="d")
    now = 100.0
    cached = frozenset(short_hash(h) for h in hashes[:3])
    replicas = [
        ReplicaLoad("holds-prefix-only", cached_blocks=cached, adapters=frozenset()),
        ReplicaLoad("holds-adapter", cached_blocks=frozenset(short_hash(h) for h in hashes[:1]),
                    adapters=frozenset({"sql"})),
        ReplicaLoad("holds-both", cached_blocks=frozenset(short_hash(h) for h in hashes[:2]),
                    adapters=frozenset({"sql", "x"})),
    ]
    assert (policy.route(hashes, replicas, now, adapter="sql").ranked
            == ["holds-both", "holds-adapter", "holds-prefix-only"])
    assert policy.route(hashes, replicas, now).ranked[0] == "holds-prefix-only"  # no adapter: prefix alone
    # A busy holder spills to a replica that will load the adapter.
    busy = [ReplicaLoad("holder", num_waiting=4, adapters=frozenset({"sql"})),
            ReplicaLoad("idle", adapters=frozenset())]
    assert policy.route(hashes, busy, now, adapter="sql").ranked[0] == "idle"


def test_lora_routing_remembers_where_it_sent_an_adapter_until_a_newer_report():
    policy = PrefixRouterPolicy(PrefixRouterConfig(block_size=BS))
    short = hash_block_chain([9] * BS, BS, lora_digest="d")  # a short prompt: load and adapter alone decide
    fresh = [ReplicaLoad("a", adapters=frozenset(), stats_age_s=1.0),
             ReplicaLoad("b", adapters=frozenset(), stats_age_s=1.0)]
    first = policy.route(short, fresh, 10.0, adapter="sql").ranked[0]
    policy.record(short, first, 10.0, adapter="sql")
    policy.complete(first)
    for _ in range(5):  # reports taken before the routing cannot show the adapter yet
        assert policy.route(short, fresh, 10.5, adapter="sql").ranked[0] == first
    newer = [ReplicaLoad(r.replica_id, adapters=frozenset(), stats_age_s=0.1) for r in fresh]
    assert policy.route(short, newer, 12.0, adapter="sql").reason == "short_prompt"
    assert not policy.holds_adapter(newer[0 if first == "a" else 1], "sql", 12.0)  # evicted since, per the report


def test_sends_nobody_completes_count_as_queued_until_a_later_report_can_show_them():
    # The ingress request router only picks (HAProxy forwards the request): record_sent, never complete.
    policy = PrefixRouterPolicy(PrefixRouterConfig(block_size=BS))
    fresh = {rid: ReplicaLoad(rid, stats_age_s=0.5, cached_blocks=frozenset()) for rid in ("a", "b")}
    first = policy.route(prompt(1, 0), list(fresh.values()), now=100.0).ranked[0]
    for i in range(3):  # sent since the last report: queued there, so the prefix spills at last
        policy.record_sent(prompt(1, i), first, now=100.0 + 0.1 * i)
    assert policy.route(prompt(1, 9), list(fresh.values()), now=100.3).ranked[0] != first
    # A report taken after them shows what is left of them; they no longer count, and affinity wins again.
    assert policy.route(prompt(1, 9), list(fresh.values()), now=101.5).ranked[0] == first
    # Past max_stats_age_s they are dropped, not kept in flight forever: with no reports at all, only the later
    # send to the other replica still counts.
    other = "b" if first == "a" else "a"
    unreported = [ReplicaLoad(rid, stats_age_s=float("inf")) for rid in ("a", "b")]
    assert policy.route(prompt(3, 0, prefix_blocks=0), unreported, now=101.0).ranked[0] == other
    policy.record_sent(prompt(2, 0), other, now=100.0 + policy.config.max_stats_age_s + 1)
    assert policy.route(prompt(3, 0, prefix_blocks=0), unreported, now=106.5).ranked[0] == first


def test_a_shared_image_routes_to_the_replica_holding_it():
    """Two requests with the same text and placeholder tokens but different images: the router matches the
    image's blocks only on the replica that cached that image, and the other image only up to it."""
    import numpy as np

    from engine.multimodal.inputs import MultiModalInput

    tokens = [7] * (2 * BS) + [32004] * (4 * BS) + [9] * (2 * BS)  # text, an image's placeholders, text

    def image(content_hash: str) -> list[int]:
        return hash_block_chain(tokens, BS, mm_inputs=[MultiModalInput(content_hash, 2 * BS, 4 * BS, np.zeros(1))])

    cat, dog = image("cat"), image("dog")
    assert cat[:2] == dog[:2] and cat[2] != dog[2]  # the text before the image is shared; nothing after it
    loads = replicas(a=ReplicaLoad("a", cached_blocks=holding(dog, 8)),
                     b=ReplicaLoad("b", cached_blocks=holding(cat, 8)))
    d = PrefixRouterPolicy().route(cat, loads, now=0.0)
    assert d.ranked[0] == "b" and d.matched_blocks == 8
    d = PrefixRouterPolicy().route(dog, loads, now=0.0)
    assert d.ranked[0] == "a" and d.matched_blocks == 8
