"""A generated DailyDialog-like corpus: the embedded default that needs no network.

DailyDialog (Li et al., 2017) has 13,118 dialogs with 7.9 turns per dialog and 14.6 tokens per turn on
average; both distributions are right-skewed (2 to 35 turns; turns from one word to a few hundred). The
generator draws turns per dialog and tokens per turn to match those means and that long tail, and fills
each turn with words from a small English vocabulary, one word ~ one token of the local BPE tokenizer, so
the token statistics after tokenization land on the targets (``tests/unit/test_data.py`` checks them).

The corpus is a pure function of (num_dialogs, seed). The same distributions give example lengths without
text for benchmarks, reports and tests (``dailydialog_like_lengths``, and ``heavy_tailed_lengths``,
``ultrafeedback_like_pairs``, ``WORKLOADS``).
"""

from __future__ import annotations

import numpy as np

MEAN_TURNS = 7.9
MEAN_TOKENS_PER_TURN = 14.6
MIN_TURNS, MAX_TURNS = 2, 35
MAX_TOKENS_PER_TURN = 280

_WORDS = """
the be to of and a in that have i it for not on with he as you do at this but his by from they we say
her she or an will my one all would there their what so up out if about who get which go me when make
can like time no just him know take people into year your good some could them see other than then now
look only come its over think also back after use two how our work first well way even new want because
any these give day most us is are was were been has had did said made went got thanks please sorry yes
okay sure really very much many more little great nice fine right here where why tomorrow today tonight
morning evening night week weekend month friend family mother father brother sister children teacher
doctor manager office school class lesson book paper letter email phone call meeting party dinner lunch
breakfast coffee tea water food restaurant hotel room house home apartment rent price money pay card
cash bank shop store market buy sell order ticket train bus car taxi airport flight station street road
city town park beach weather rain sun cold hot warm wind snow holiday trip travel visit plan idea problem
question answer help need try ask tell talk speak listen hear read write watch play learn teach study
start finish open close wait stay leave arrive bring carry send receive change check clean cook drive
walk run sit stand sleep wake feel seem keep let mean meet pass remember forget understand believe hope
wish love hate enjoy prefer agree worry happy sad tired busy free late early ready sorry glad afraid
sick hungry thirsty expensive cheap big small long short old young easy difficult important interesting
boring beautiful terrible wonderful excellent different same next last every each both few several
minute hour o'clock half quarter job interview company boss salary project report computer internet
music movie film game sport football basketball tennis swim dance sing picture camera birthday gift
present wedding hospital medicine health exercise gym dress shirt shoes size color red blue green black
white left straight corner block near far across behind front between inside outside maybe perhaps
probably usually always often sometimes never already still yet again soon ago together alone
""".split()

_PUNCTUATION = (".", "?", "!")


def _turn_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """Tokens per turn: a log-normal body with a heavy right tail, mean ~14.6, at least 2 tokens."""
    sigma = 0.62
    mu = np.log(MEAN_TOKENS_PER_TURN) - sigma**2 / 2
    lengths = np.rint(rng.lognormal(mu, sigma, size=n))
    return np.clip(lengths, 2, MAX_TOKENS_PER_TURN).astype(np.int64)


def _dialog_turns(rng: np.random.Generator, n: int) -> np.ndarray:
    """Turns per dialog: 2 + a negative binomial with mean 5.9 (so 7.9 in all), capped at 35."""
    extra_mean, dispersion = MEAN_TURNS - MIN_TURNS, 2.2
    p = dispersion / (dispersion + extra_mean)
    return np.clip(MIN_TURNS + rng.negative_binomial(dispersion, p, size=n), MIN_TURNS, MAX_TURNS)


def generate_dialogs(num_dialogs: int = 13118, seed: int = 1234) -> list[list[str]]:
    """Return ``num_dialogs`` dialogs, each a list of utterance strings (one per turn)."""
    rng = np.random.default_rng(seed)
    turns_per_dialog = _dialog_turns(rng, num_dialogs)
    turn_tokens = _turn_lengths(rng, int(turns_per_dialog.sum()))
    words = np.array(_WORDS)
    word_ids = rng.integers(0, len(words), size=int(turn_tokens.sum()))
    punct = rng.integers(0, len(_PUNCTUATION), size=len(turn_tokens))

    dialogs: list[list[str]] = []
    turn, word = 0, 0
    for n_turns in turns_per_dialog:
        dialog = []
        for _ in range(n_turns):
            n_words = int(turn_tokens[turn]) - 1  # the closing punctuation is the last token
            text = " ".join(words[word_ids[word : word + n_words]])
            dialog.append(text[:1].upper() + text[1:] + _PUNCTUATION[punct[turn]])
            word += n_words
            turn += 1
        dialogs.append(dialog)
    return dialogs


SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a friendly assistant who answers in short sentences.",
    "Answer the question and be polite.",
)


def generate_chats(num_chats: int = 2000, seed: int = 1234) -> list[list[dict]]:
    """Return ``num_chats`` chat conversations (``[{role, content}, ...]``) built from generated dialogs:
    an optional system prompt, then user and assistant messages taking turns (an even count, so every
    conversation ends with the assistant). A pure function of (num_chats, seed)."""
    rng = np.random.default_rng(seed + 1)
    chats = []
    for turns in generate_dialogs(num_chats, seed):
        turns = turns[: len(turns) - len(turns) % 2]
        messages = (
            [{"role": "system", "content": SYSTEM_PROMPTS[rng.integers(len(SYSTEM_PROMPTS))]}]
            if rng.random() < 0.5
            else []
        )
        messages += [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(turns)]
        chats.append(messages)
    return chats


def generate_reasoning_traces(
    num_traces: int = 600, seed: int = 1234, mean_tokens: int = 420, max_tokens: int = 2000
) -> list[list[str]]:
    """Return ``num_traces`` long-context examples shaped like reasoning-trace SFT data: a short question
    turn, then one long "thinking + answer" turn whose length is log-normal with a heavy right tail (mean
    ~``mean_tokens``, capped at ``max_tokens``), so a good share exceeds one rank's budget and wants
    context parallelism (``recipe=cpu_long_context``). A pure function of its arguments."""
    rng = np.random.default_rng(seed + 2)
    sigma = 0.9
    mu = np.log(mean_tokens) - sigma**2 / 2
    trace_tokens = np.clip(np.rint(rng.lognormal(mu, sigma, size=num_traces)), 8, max_tokens).astype(np.int64)
    question_tokens = _turn_lengths(rng, num_traces)
    words = np.array(_WORDS)
    traces = []
    for q, t in zip(question_tokens, trace_tokens, strict=True):
        question = " ".join(words[rng.integers(0, len(words), size=int(q) - 1)]) + "?"
        trace = " ".join(words[rng.integers(0, len(words), size=int(t) - 1)]) + "."
        traces.append([question[:1].upper() + question[1:], trace[:1].upper() + trace[1:]])
    return traces


PREFERRED_SHARE = 0.6
"""Share of a reply's words drawn from its side's half of the vocabulary (0.5: no preference to learn)."""


def generate_preference_pairs(
    num_pairs: int = 2000, seed: int = 1234, mean_reply_tokens: int = 60, max_reply_tokens: int = 600
) -> list[dict]:
    """Return ``num_pairs`` preference pairs in TRL's conversational format (``prompt``: a user turn,
    sometimes after a system prompt; ``chosen`` / ``rejected``: one assistant message each). Reply lengths
    are drawn apart for the two replies, log-normal with a heavy right tail (mean ~``mean_reply_tokens``,
    capped at ``max_reply_tokens``), so pairs spread in length as real ones do. The preference is learnable:
    a chosen reply draws ``PREFERRED_SHARE`` of its words from one half of the vocabulary, a rejected one
    from the other half, so a policy that moves mass between the halves ranks the pairs right (``recipes/cpu_dpo.yaml``
    shows its reward accuracy rising). A pure function of its arguments."""
    rng = np.random.default_rng(seed + 3)
    words = np.array(_WORDS)
    good, bad = words[: len(words) // 2], words[len(words) // 2 :]
    sigma = 0.9
    mu = np.log(mean_reply_tokens) - sigma**2 / 2
    replies = np.clip(np.rint(rng.lognormal(mu, sigma, size=(num_pairs, 2))), 3, max_reply_tokens).astype(np.int64)
    questions = _turn_lengths(rng, num_pairs)

    def sentence(n: int, preferred: np.ndarray, other: np.ndarray, end: str) -> str:
        picks = np.where(rng.random(n) < PREFERRED_SHARE, rng.choice(preferred, n), rng.choice(other, n))
        text = " ".join(picks)
        return text[:1].upper() + text[1:] + end

    pairs = []
    for (n_chosen, n_rejected), q in zip(replies, questions, strict=True):
        prompt = (
            [{"role": "system", "content": SYSTEM_PROMPTS[rng.integers(len(SYSTEM_PROMPTS))]}]
            if rng.random() < 0.3
            else []
        )
        prompt.append({"role": "user", "content": sentence(int(q) - 1, words, words, "?")})
        pairs.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": sentence(int(n_chosen) - 1, good, bad, ".")}],
                "rejected": [{"role": "assistant", "content": sentence(int(n_rejected) - 1, bad, good, ".")}],
            }
        )
    return pairs


# ------------------------------------------------------------------------------- lengths without text
# Example-length distributions for benchmarks, reports and tests (no tokenizer, no text):
# ``dailydialog_like_lengths``: tokens per rendered dialog (``BOS turn EOS turn EOS ...``) drawn from the same
# turn-count and turn-length distributions as ``generate_dialogs`` (7.9 turns of 14.6 tokens on average,
# right-skewed, a few hundred tokens at most); ``heavy_tailed_lengths``: a Pareto tail (alpha 1.3), most examples
# short, a few very long (long documents mixed with chat), the hard case for packing and for rank balance;
# ``ultrafeedback_like_pairs``: preference pairs' prompt / chosen / rejected lengths (log-normal, medians
# 150 / 250 / 250, a tail to 1.5k; an assumption, not measured on UltraFeedback): ``benchmarks/dpo.py``'s pairs.
def dailydialog_like_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Tokens per rendered dialog of ``generate_dialogs``' distributions (no text)."""
    rng = np.random.default_rng(seed)
    turns = _dialog_turns(rng, n)
    per_turn = _turn_lengths(rng, int(turns.sum())) + 1  # + EOS
    starts = np.r_[0, np.cumsum(turns)[:-1]]
    return 1 + np.add.reduceat(per_turn, starts)  # + BOS


def heavy_tailed_lengths(n: int, seed: int = 0, scale: int = 64, alpha: float = 1.3, cap: int = 65536) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(np.ceil(scale * (1 + rng.pareto(alpha, size=n))), cap).astype(np.int64)


def ultrafeedback_like_pairs(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Tokens of each pair's ``prompt``, ``chosen`` and ``rejected`` (drawn from ``rng`` in that order): the prompt
    log-normal with median 150 (sigma 0.6, 8..512), each reply median 250 (sigma 0.7, 4..1536), independent."""
    return {
        "prompt": np.clip(rng.lognormal(np.log(150), 0.6, n), 8, 512).astype(int),
        "chosen": np.clip(rng.lognormal(np.log(250), 0.7, n), 4, 1536).astype(int),
        "rejected": np.clip(rng.lognormal(np.log(250), 0.7, n), 4, 1536).astype(int),
    }


WORKLOADS = {"dailydialog_like": dailydialog_like_lengths, "heavy_tailed": heavy_tailed_lengths}
