"""Speculative decoding, statistically, end to end: a toy target and draft generate length-3
continuations with speculation; a chi-square test accepts them as the target's own sequence
distribution, and rejects three plausible mistakes (negative controls). Then the number of
tokens per target pass matches (1 - α^(k+1)) / (1 - α) for a proposer of known α.

Everything runs as one vectorized batch of N sequences per case, with a fixed seed.
"""

import math
from dataclasses import dataclass

import numpy as np
import pytest

from refserve.backends import NumpyBackend
from refserve.metrics import expected_tokens_per_pass, spec_mean_accepted_length
from refserve.sampling import rejection_sampler
from refserve.sampling.rejection_sampler import inverse_cdf_draw, rejection_sample
from refserve.sampling.warping import warp
from refserve.sampling_params import SamplingParams

SIGNIFICANCE = 1e-3
NUM_SEQUENCES = 100_000
VOCAB = 6
LENGTH = 3  # generated tokens per sequence
PROMPT = (2, 5)


@dataclass
class VerifyCounts:
    """Over many verify steps: the steps with drafts, the drafts accepted, and the
    rejections (one failed test each). α is estimated from the tests actually run: every
    accepted draft is one passed test, every rejection one failed test."""

    steps: int = 0
    accepted: int = 0
    rejections: int = 0

    def add(self, num_draft: np.ndarray, num_accepted: np.ndarray) -> None:
        speculated = num_draft > 0
        self.steps += int(speculated.sum())
        self.accepted += int(num_accepted[speculated].sum())
        self.rejections += int((num_accepted < num_draft).sum())

    @property
    def alpha_estimate(self) -> float:
        return self.accepted / (self.accepted + self.rejections)


# ------------------------------------------------------------ chi-square test


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularised upper incomplete gamma
    Q(df/2, stat/2), by its power series (x < a + 1) or its continued fraction (otherwise)."""
    a, x = df / 2.0, stat / 2.0
    if x <= 0:
        return 1.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # P(a, x) = e^-x x^a / Γ(a) Σ_n x^n / (a (a+1) ... (a+n))
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= x / (a + n)
            total += term
        return max(0.0, 1.0 - math.exp(log_prefactor) * total)
    # Q(a, x) = e^-x x^a / Γ(a) · 1 / (x + 1 - a - 1(1-a) / (x + 3 - a - 2(2-a) / ...)),
    # evaluated by the modified Lentz method.
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return math.exp(log_prefactor) * h


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's goodness of fit of `counts` to `probs`; cells expecting fewer than 5 counts
    are pooled into one (the chi-square approximation needs enough per cell)."""
    n = counts.sum()
    expected = n * probs
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(stat, len(obs) - 1)


def test_chi2_sf_matches_known_values():
    # Critical values at 1e-3 from tables (df 1, 10, 100) and the exponential for df = 2.
    assert chi2_sf(10.828, 1) == pytest.approx(1e-3, rel=1e-3)
    assert chi2_sf(29.588, 10) == pytest.approx(1e-3, rel=1e-3)
    assert chi2_sf(149.449, 100) == pytest.approx(1e-3, rel=1e-3)
    for x in (0.5, 3.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 7, 50, 215):
        for x in (0.1 * df, df, 1.5 * df + 3):
            assert chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9)


# --------------------------------------------------- toy target and draft models

# Target: next-token logits depend on the last two tokens; draft: on the last token only.
# Both are fixed random tables, the draft a noisy copy of the target's average, so α is
# middling (about 0.5-0.7) and both acceptances and rejections are frequent.
_rng = np.random.default_rng(1234)
TARGET_LOGITS = 1.5 * _rng.normal(size=(VOCAB, VOCAB, VOCAB))
DRAFT_LOGITS = TARGET_LOGITS.mean(axis=0) + 1.0 * _rng.normal(size=(VOCAB, VOCAB))


def warped_tables(temperature, top_k, top_p, draft_temperature=None):
    """p[a, b] = warped target distribution after context (.., a, b); q[b] = warped draft
    after (.., b). `draft_temperature` overrides q's temperature (a negative control)."""
    t_q = temperature if draft_temperature is None else draft_temperature
    target = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    draft = SamplingParams(temperature=t_q, top_k=top_k, top_p=top_p)
    p = warp(TARGET_LOGITS.reshape(-1, VOCAB), [target] * VOCAB * VOCAB, NumpyBackend())
    q = warp(DRAFT_LOGITS, [draft] * VOCAB, NumpyBackend())
    return p.reshape(VOCAB, VOCAB, VOCAB).astype(np.float64), q.astype(np.float64)


def target_sequence_distribution(p_table):
    """P(y1, y2, y3 | PROMPT) = p[PROMPT](y1) p[PROMPT[1], y1](y2) p[y1, y2](y3), flat."""
    a, b = PROMPT
    first = p_table[a, b]  # [y1]
    second = p_table[b]  # [y1, y2]
    third = p_table  # [y1, y2, y3]
    return (first[:, None, None] * second[:, :, None] * third).reshape(-1)


def generate(k, p_table, q_table, q_verify_table, rng, sample=rejection_sample):
    """N length-3 continuations of PROMPT by speculative decoding, as one vectorized batch.

    Each round, every unfinished sequence drafts tokens from q_table: k of them in even
    rows, a random 0..k in odd rows (ragged: padded with -1). The target's p at every draft
    position comes from p_table, and `sample` (the rejection sampler under test) decides what
    is emitted, verifying with `q_verify_table`. Tokens past the third are dropped: a prefix
    of a sample from the target is a sample of the prefix."""
    n = NUM_SEQUENCES
    tokens = np.zeros((n, len(PROMPT) + LENGTH), dtype=np.int64)
    tokens[:, : len(PROMPT)] = PROMPT
    generated = np.zeros(n, dtype=np.int64)
    stats = VerifyCounts()
    while (generated < LENGTH).any():
        rows = np.flatnonzero(generated < LENGTH)
        m = len(rows)
        end = len(PROMPT) + generated[rows]  # index of the next token
        num_draft = np.where(rows % 2 == 0, k, rng.integers(0, k + 1, size=m))
        # context[:, 0:2] = the last two tokens, then the drafts.
        context = np.zeros((m, 2 + k), dtype=np.int64)
        context[:, 0] = tokens[rows, end - 2]
        context[:, 1] = tokens[rows, end - 1]
        drafts = np.full((m, k), -1, dtype=np.int64)
        q = np.zeros((m, k, VOCAB))
        for i in range(k):
            q[:, i] = q_verify_table[context[:, i + 1]]
            draw = inverse_cdf_draw(q_table[context[:, i + 1]], rng.random(m))
            drafts[:, i] = np.where(i < num_draft, draw, -1)
            context[:, i + 2] = draw  # past num_draft these are never read as context
        p = np.stack([p_table[context[:, i], context[:, i + 1]] for i in range(k + 1)], 1)
        out, num_accepted = sample(drafts, q, p, rng.random((m, k)), rng.random(m))
        stats.add(num_draft, num_accepted)
        room = LENGTH - generated[rows]
        for j in range(k + 1):
            emit = (out[:, j] >= 0) & (j < room)
            tokens[rows[emit], end[emit] + j] = out[emit, j]
        generated[rows] += np.minimum((out >= 0).sum(axis=1), room)
    assert (generated == LENGTH).all()
    seq = tokens[:, len(PROMPT):]
    return np.bincount((seq[:, 0] * VOCAB + seq[:, 1]) * VOCAB + seq[:, 2],
                       minlength=VOCAB**LENGTH), stats


# ------------------------------------------------------------ the mistakes


def resample_from_p_instead_of_residual(monkeypatch):
    """Mistake 1: at a rejection, draw the replacement from p instead of max(0, p - q)."""
    monkeypatch.setattr(rejection_sampler, "residual_weights",
                        lambda p, q: np.asarray(p, dtype=np.float64).copy())
    return rejection_sample


def bonus_from_the_last_draft_position(monkeypatch):
    """Mistake 2: the bonus token drawn from the last draft's distribution p_{n-1} instead of
    the next one p_n (an off-by-one that repeats a verified position instead of using the
    free extra one). Injected through the inputs: p_n is overwritten with p_{n-1}."""

    def sample(drafts, q, p, u, w):
        n = (drafts >= 0).sum(axis=1)
        wrong = p.copy()
        has = np.flatnonzero(n > 0)
        wrong[has, n[has]] = p[has, n[has] - 1]
        return rejection_sample(drafts, q, wrong, u, w)

    return sample


CONFIGS = {
    # temperature, top_k, top_p
    "T=0.6": (0.6, -1, 1.0),
    "T=1.3 top_k=4 top_p=0.85": (1.3, 4, 0.85),
}


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_speculative_sequences_follow_the_target(config, k):
    temperature, top_k, top_p = CONFIGS[config]
    p_table, q_table = warped_tables(temperature, top_k, top_p)
    rng = np.random.default_rng(100 + k)
    counts, stats = generate(k, p_table, q_table, q_table, rng)
    p_value = chi_square_p_value(counts, target_sequence_distribution(p_table))
    assert p_value > SIGNIFICANCE, (
        f"speculative output does not follow the target (k={k}, {config}): p = {p_value:.2e}"
    )
    # Both paths of the sampler were exercised many times.
    assert 0.3 < stats.alpha_estimate < 0.9 and stats.rejections > 10_000


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(
    "mistake", ["resample from p", "bonus from the last draft position", "q without temperature"]
)
def test_negative_controls_are_rejected(mistake, k, monkeypatch):
    temperature, top_k, top_p = CONFIGS["T=0.6"]
    p_table, q_table = warped_tables(temperature, top_k, top_p)
    q_verify, sample = q_table, rejection_sample
    if mistake == "resample from p":
        sample = resample_from_p_instead_of_residual(monkeypatch)
    elif mistake == "bonus from the last draft position":
        sample = bonus_from_the_last_draft_position(monkeypatch)
    else:  # Mistake 3: drafts sampled at temperature T, verified with q at temperature 1.
        _, q_verify = warped_tables(temperature, top_k, top_p, draft_temperature=1.0)
    rng = np.random.default_rng(100 + k)
    counts, _ = generate(k, p_table, q_table, q_verify, rng, sample=sample)
    p_value = chi_square_p_value(counts, target_sequence_distribution(p_table))
    assert p_value < SIGNIFICANCE, f"the test failed to catch '{mistake}' (k={k}): p = {p_value}"


# ------------------------------------------- tokens per target pass, known α


def drops_the_bonus_token(drafts, q, p, u, w):
    """Mistake 4: when every draft is accepted, emit no bonus token. The output still
    follows p (the next step samples that position afresh), so no distribution test can see
    it; it shows up as fewer tokens per target pass."""
    out, num_accepted = rejection_sample(drafts, q, p, u, w)
    all_accepted = np.flatnonzero(num_accepted == (drafts >= 0).sum(axis=1))
    out[all_accepted, num_accepted[all_accepted]] = -1
    return out, num_accepted


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_tokens_per_pass_match_the_formula(alpha, k):
    """p = [α, 1-α, 0], q = [α, 0, 1-α] at every position: Σ min(p, q) = α, and each draft
    is accepted independently with probability α. The mean tokens emitted per verify step
    must match (1 - α^(k+1)) / (1 - α) within 4.5 standard errors; a sampler that drops the
    bonus token must not."""
    n = 200_000
    rng = np.random.default_rng(7)
    p = np.array([alpha, 1 - alpha, 0.0])
    q = np.array([alpha, 0.0, 1 - alpha])
    drafts = inverse_cdf_draw(np.tile(q, (n * k, 1)), rng.random(n * k)).reshape(n, k)
    args = (drafts, np.broadcast_to(q, (n, k, 3)), np.broadcast_to(p, (n, k + 1, 3)),
            rng.random((n, k)), rng.random(n))
    expected = expected_tokens_per_pass(alpha, k)

    out, num_accepted = rejection_sample(*args)
    emitted = (out >= 0).sum(axis=1)
    half_width = 4.5 * emitted.std() / math.sqrt(n)
    assert abs(emitted.mean() - expected) < half_width, (emitted.mean(), expected)

    stats = VerifyCounts()
    stats.add(np.full(n, k), num_accepted)
    assert spec_mean_accepted_length(stats.steps, stats.accepted) == pytest.approx(
        emitted.mean(), rel=1e-12)
    # α recovered from the tests actually run (binomial standard error).
    tests = stats.accepted + stats.rejections
    assert abs(stats.alpha_estimate - alpha) < 4.5 * math.sqrt(alpha * (1 - alpha) / tests)

    if alpha**k < 0.05:
        return  # the bonus is rarely reached: too little power for the negative control
    wrong_out, _ = drops_the_bonus_token(*args)
    wrong = (wrong_out >= 0).sum(axis=1)
    assert abs(wrong.mean() - expected) > 4.5 * wrong.std() / math.sqrt(n), (
        "dropping the bonus token went unnoticed"
    )
