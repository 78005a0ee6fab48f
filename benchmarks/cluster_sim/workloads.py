"""Seeded request streams in the shapes that decide whether prefix-aware routing and KV-aware scaling pay
off (reference/routing_autoscaling.md, section 9), scaled to what a CPU replica of the 56M model serves.

Every request carries token ids (what the engine caches and the block-hash routers see), a deterministic
text for them (what Ray's character-level prefix tree sees: one word per token), and the exact tokens the
"model" will answer, so that a chat's next turn, which repeats that answer, can hit the cache too.
A chat turn is closed-loop: it arrives a think time after its predecessor's last token.

Shapes:
- multi_tenant: llm-d's B2B benchmark shrunk (many tenants, each a long shared system prompt, short
  distinct questions, short answers, Poisson arrivals); its tenant count is sized so that the tenants'
  prefixes fill a given fraction of the cluster's KV blocks.
- multi_turn: chat sessions sharing one global system prompt; each turn's prompt is the whole history.
- zipf: documents with Zipf popularity, so the hottest prefix alone needs more than one replica.
- bursty: the multi-tenant request shape under a piecewise rate (steps of 4-5x and an idle gap).
- io_mix: fixed input:output lengths, no shared prefixes (the P/D comparison's 200:200, 2000:200, 8000:500).
- chat_and_long: short chat streams while long prompts arrive (the P/D live benchmark's shape)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.block_hash import BlockHash, hash_block_chain

VOCAB = 32000
_FIRST_TOKEN = 3  # below: special tokens (unk, bos, eos)
_LETTERS = "etaoinshrdlucmfwypvbgkqjxz"


def token_word(token: int) -> str:
    """A deterministic word per token id (base-26 digits, most frequent letters first), with its space."""
    word = []
    while True:
        token, digit = divmod(token, 26)
        word.append(_LETTERS[digit])
        if token == 0:
            return "".join(word) + " "


_WORDS = [token_word(t) for t in range(VOCAB)]


@dataclass(eq=False)
class SimRequest:
    request_id: str
    arrival: float  # seconds; for a follow-up turn: filled in when its predecessor finishes
    group: str  # what shares a prefix: tenant, session or document
    prompt: list[int]
    output: list[int]  # the tokens the simulated model answers
    follows: str | None = None  # a chat turn: arrives think_time after this request finishes
    think_time: float = 0.0
    _text: str | None = field(default=None, repr=False)
    _hashes: list[BlockHash] | None = field(default=None, repr=False)

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = "".join(_WORDS[t] for t in self.prompt)
        return self._text

    def block_hashes(self, block_size: int) -> list[BlockHash]:
        if self._hashes is None:
            self._hashes = hash_block_chain(self.prompt, block_size)
        return self._hashes


@dataclass
class Workload:
    name: str
    requests: list[SimRequest]
    description: str
    working_set_blocks: int  # blocks of the prefixes that recur; 0: measured by the simulation (chat)

    @property
    def num_requests(self) -> int:
        return len(self.requests)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(_FIRST_TOKEN, VOCAB) for _ in range(n)]


def _blocks(n_tokens: int, block_size: int) -> int:
    return n_tokens // block_size


def poisson_arrivals(rng: random.Random, rate_at: Sequence[tuple[float, float]], end: float) -> list[float]:
    """Arrival times of a Poisson process whose rate is piecewise constant: `rate_at` lists
    (start time, requests/s) steps, sorted by start time."""
    times = []
    for i, (start, rate) in enumerate(rate_at):
        stop = rate_at[i + 1][0] if i + 1 < len(rate_at) else end
        t = start
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= stop:
                break
            times.append(t)
    return times


@dataclass
class TenantShape:
    prefix_len: tuple[int, int] = (512, 1536)  # shared system prompt, tokens (uniform)
    question_len: tuple[int, int] = (64, 256)
    output_len: tuple[int, int] = (16, 96)


def _tenant_prefixes(rng: random.Random, shape: TenantShape, budget_blocks: int, block_size: int) -> list[list[int]]:
    """Tenants' system prompts until their blocks reach `budget_blocks`."""
    prefixes, blocks = [], 0
    while blocks < budget_blocks:
        prefix = _tokens(rng, rng.randint(*shape.prefix_len))
        prefixes.append(prefix)
        blocks += _blocks(len(prefix), block_size)
    return prefixes


def _tenant_requests(
    rng: random.Random, name: str, prefixes: list[list[int]], arrivals: list[float], shape: TenantShape,
    weights: list[float] | None = None,
) -> list[SimRequest]:
    requests = []
    for i, t in enumerate(arrivals):
        g = rng.choices(range(len(prefixes)), weights)[0] if weights else rng.randrange(len(prefixes))
        prompt = prefixes[g] + _tokens(rng, rng.randint(*shape.question_len))
        requests.append(SimRequest(f"{name}-{i}", t, f"t{g}", prompt, _tokens(rng, rng.randint(*shape.output_len))))
    return requests


def multi_tenant(
    seed: int, rate: float, duration_s: float, cluster_blocks: int, kv_pressure: float = 0.7,
    block_size: int = 16, shape: TenantShape | None = None,
) -> Workload:
    """Tenants are added until their shared prefixes take `kv_pressure` of `cluster_blocks`."""
    shape = shape or TenantShape()
    rng = random.Random(seed)
    prefixes = _tenant_prefixes(rng, shape, round(kv_pressure * cluster_blocks), block_size)
    arrivals = poisson_arrivals(rng, [(0.0, rate)], duration_s)
    ws = sum(_blocks(len(p), block_size) for p in prefixes)
    return Workload(
        "multi_tenant", _tenant_requests(rng, "mt", prefixes, arrivals, shape),
        f"{len(prefixes)} tenants, prefixes {shape.prefix_len} tok, questions {shape.question_len}, "
        f"outputs {shape.output_len}, Poisson {rate:g}/s for {duration_s:g} s", ws,
    )


def zipf(
    seed: int, rate: float, duration_s: float, num_docs: int = 200, alpha: float = 1.2,
    block_size: int = 16, shape: TenantShape | None = None,
) -> Workload:
    shape = shape or TenantShape()
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randint(*shape.prefix_len)) for _ in range(num_docs)]
    weights = zipf_weights(num_docs, alpha)
    arrivals = poisson_arrivals(rng, [(0.0, rate)], duration_s)
    ws = sum(_blocks(len(p), block_size) for p in prefixes)
    return Workload(
        "zipf", _tenant_requests(rng, "zipf", prefixes, arrivals, shape, weights),
        f"{num_docs} documents, Zipf alpha {alpha:g} (hottest {weights[0]:.0%} of requests), prefixes "
        f"{shape.prefix_len} tok, Poisson {rate:g}/s for {duration_s:g} s", ws,
    )


def zipf_weights(n: int, alpha: float) -> list[float]:
    raw = [1 / (k**alpha) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def bursty(
    seed: int, phases: Sequence[tuple[float, float]], num_tenants: int = 32, block_size: int = 16,
    shape: TenantShape | None = None,
) -> Workload:
    """`phases`: (duration s, requests/s) steps, e.g. base, 4x burst, base, idle, 5x burst, base."""
    shape = shape or TenantShape()
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randint(*shape.prefix_len)) for _ in range(num_tenants)]
    steps, t = [], 0.0
    for duration, rate in phases:
        steps.append((t, rate))
        t += duration
    arrivals = poisson_arrivals(rng, steps, t)
    ws = sum(_blocks(len(p), block_size) for p in prefixes)
    rates = " -> ".join(f"{r:g}/s x {d:g} s" for d, r in phases)
    return Workload("bursty", _tenant_requests(rng, "burst", prefixes, arrivals, shape),
                    f"{num_tenants} tenants (multi-tenant shape), {rates}", ws)


@dataclass
class ChatShape:
    system_len: int = 256  # one system prompt shared by every session
    user_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (32, 160)
    turns: tuple[int, int] = (3, 10)
    think_s: tuple[float, float] = (3.0, 20.0)
    max_prompt: int = 6000  # a session ends before its history would exceed this


def multi_turn(seed: int, session_rate: float, duration_s: float, block_size: int = 16,
               shape: ChatShape | None = None) -> Workload:
    """Sessions start as a Poisson process; turn k's prompt is the system prompt and every earlier user
    message and answer, then the new message. Only a session's first turn has an absolute arrival."""
    shape = shape or ChatShape()
    rng = random.Random(seed)
    system = _tokens(rng, shape.system_len)
    requests: list[SimRequest] = []
    sessions = 0
    for s, start in enumerate(poisson_arrivals(rng, [(0.0, session_rate)], duration_s)):
        sessions += 1
        history, previous = list(system), None
        for k in range(rng.randint(*shape.turns)):
            prompt = history + _tokens(rng, rng.randint(*shape.user_len))
            output = _tokens(rng, rng.randint(*shape.output_len))
            if len(prompt) + len(output) > shape.max_prompt:
                break
            req = SimRequest(f"chat-{s}-{k}", start if previous is None else math.nan, f"s{s}", prompt, output,
                             follows=previous, think_time=0.0 if previous is None else rng.uniform(*shape.think_s))
            requests.append(req)
            history, previous = prompt + output, req.request_id
    # The working set depends on how long sessions live, which the simulation decides: measured there.
    return Workload(
        "multi_turn", requests,
        f"{sessions} sessions (Poisson {session_rate:g}/s for {duration_s:g} s), {shape.turns} turns, "
        f"think {shape.think_s} s, user {shape.user_len} / answer {shape.output_len} tok, "
        f"{shape.system_len}-tok shared system prompt", 0,
    )


def io_mix(seed: int, rate: float, duration_s: float, input_len: int, output_len: int) -> Workload:
    """Poisson arrivals of `input_len`-token prompts answered with `output_len` tokens; nothing shared, so
    no prefix cache (or prefix routing) changes the picture: what is compared is where prefills run."""
    rng = random.Random(seed)
    name = f"{input_len}:{output_len}"
    requests = [SimRequest(f"io-{i}", t, f"r{i}", _tokens(rng, input_len), _tokens(rng, output_len))
                for i, t in enumerate(poisson_arrivals(rng, [(0.0, rate)], duration_s))]
    return Workload(name, requests, f"prompts {input_len} tok, outputs {output_len} tok, no shared prefix, "
                    f"Poisson {rate:g}/s for {duration_s:g} s", 0)


@dataclass
class ChatAndLongShape:
    chat_prompt: tuple[int, int] = (64, 256)
    chat_output: tuple[int, int] = (64, 128)
    long_prompt: int = 1500
    long_output: int = 32


def chat_and_long(seed: int, chat_rate: float, long_rate: float, duration_s: float,
                  shape: ChatAndLongShape | None = None) -> Workload:
    """Short chat requests (group "chat") streaming while long prompts (group "long") arrive, each a
    Poisson stream; nothing shared."""
    shape = shape or ChatAndLongShape()
    rng = random.Random(seed)
    requests = [SimRequest(f"chat-{i}", t, "chat", _tokens(rng, rng.randint(*shape.chat_prompt)),
                           _tokens(rng, rng.randint(*shape.chat_output)))
                for i, t in enumerate(poisson_arrivals(rng, [(0.0, chat_rate)], duration_s))]
    requests += [SimRequest(f"long-{i}", t, "long", _tokens(rng, shape.long_prompt), _tokens(rng, shape.long_output))
                 for i, t in enumerate(poisson_arrivals(rng, [(0.0, long_rate)], duration_s))]
    requests.sort(key=lambda r: r.arrival)
    return Workload("chat_and_long", requests,
                    f"chat: prompts {shape.chat_prompt} tok, outputs {shape.chat_output} tok, Poisson {chat_rate:g}/s; "
                    f"long: prompts {shape.long_prompt} tok, outputs {shape.long_output} tok, Poisson {long_rate:g}/s; "
                    f"{duration_s:g} s", 0)
