"""TextStream decodes incrementally: same text, deltas and stops as full re-decoding, bounded work per push."""

import random

import pytest
from dflash.defaults import DEMO_DIR
from dflash.textstream import TextStream
from tiny import char_tokenizer
from transformers import AutoTokenizer

KW = dict(skip_special_tokens=True, clean_up_tokenization_spaces=False)


class _ReferenceTextStream:
    """The former TextStream, which re-decoded every id on each push: the oracle."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop, self.token_ids, self.emitted, self.text = tokenizer, stop, [], 0, ""

    def push(self, new_tokens):
        first_new = len(self.token_ids)
        self.token_ids.extend(new_tokens)
        self.text = self.tokenizer.decode(self.token_ids, **KW)
        if self.stop:
            hit = self._find_stop()
            if hit is not None:
                keep = self._tokens_to_reach(first_new, hit)
                self.token_ids = self.token_ids[:keep]
                return self._release(hit, stop_at_token=keep)
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe = len(self.text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, safe), 0, -1):
                if self.text[safe - n : safe] == s[:n]:
                    safe = min(safe, len(self.text) - n)
                    break
        return self._release(max(safe, self.emitted))

    def flush(self):
        return self._release(len(self.text))

    def _release(self, upto, stop_at_token=None):
        delta = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        if stop_at_token is not None:
            self.text = self.text[:upto]
        return delta, stop_at_token

    def _find_stop(self):
        start = max(0, self.emitted - max(len(s) for s in self.stop))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _tokens_to_reach(self, first_new, char_index):
        for n in range(first_new + 1, len(self.token_ids) + 1):
            decoded = self.tokenizer.decode(self.token_ids[:n], **KW)
            if any(decoded.find(s, char_index) == char_index for s in self.stop):
                return n
        return len(self.token_ids)


@pytest.fixture(scope="module")
def demo():
    return AutoTokenizer.from_pretrained(str(DEMO_DIR / "target"))


def _byte_tokens(tok):
    """Ids whose own text is "\ufffd": single bytes of multi-byte UTF-8 characters."""
    return [i for i in range(len(tok)) if "\ufffd" in tok.decode([i], **KW)]


def _random_ids(rng, tok, n, byte_ids):
    pieces = ["héllo wörld ", "中文字 ", "😀🎉 ", "a = b + c\n", "ünïcödé ", "stop: END. "]
    ids = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.4:
            ids += tok(rng.choice(pieces), add_special_tokens=False)["input_ids"]
        elif r < 0.6 and byte_ids:
            ids.append(rng.choice(byte_ids))
        else:
            ids.append(rng.randrange(len(tok)))  # special tokens included
    return ids[:n]


def _run(stream, ids, rng, max_chunk, resume_at=None):
    """Push `ids` in random chunks; returns every (delta, stop_at_token) and the flush."""
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, max_chunk)
        d = stream.push(ids[i : i + k])
        out.append(d if isinstance(d, tuple) else (d.text, d.stop_at_token))
        i += k
        if resume_at is not None and i >= resume_at:  # as the engine does when resuming a request
            stream.emitted, resume_at = len(stream.text), None
        if out[-1][1] is not None:
            break
    f = stream.flush()
    return out + [f if isinstance(f, tuple) else (f.text, f.stop_at_token)]


@pytest.mark.parametrize("which", ["demo", "char"])
def test_joined_deltas_equal_the_full_decode(which, demo):
    tok = demo if which == "demo" else char_tokenizer()
    byte_ids = _byte_tokens(tok)
    assert (which == "demo") == bool(byte_ids)
    rng = random.Random(0)
    for case in range(60):
        ids = _random_ids(rng, tok, rng.randint(1, 300 if case % 10 else 3000), byte_ids)
        stream, chunk = TextStream(tok), rng.choice([1, 3, 17])
        out = _run(stream, ids, random.Random(case), chunk)
        assert "".join(d for d, _ in out) == tok.decode(ids, **KW) == stream.text
        if len(ids) <= 300:
            assert out == _run(_ReferenceTextStream(tok), ids, random.Random(case), chunk)


@pytest.mark.parametrize("which", ["demo", "char"])
def test_stop_strings_match_the_reference(which, demo):
    tok = demo if which == "demo" else char_tokenizer()
    rng = random.Random(1)
    alphabet = "ab :\n" if which == "char" else ["a", "b", " ", "中", "é", "😀", "ab", " b"]
    for case in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(1500 if case % 50 == 0 else rng.choice([20, 60])))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        stop = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3)))
        chunk, resume = rng.choice([1, 2, 5, 16]), rng.choice([None, rng.randrange(len(ids) + 1)])
        new, old = TextStream(tok, stop), _ReferenceTextStream(tok, stop)
        got = _run(new, ids, random.Random(case), chunk, resume)
        assert got == _run(old, ids, random.Random(case), chunk, resume), (text, stop)
        assert (new.text, new.token_ids, new.emitted) == (old.text, old.token_ids, old.emitted)


class _Counting:
    """The tokenizer, counting the ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.ids, self.all_special_ids = tok, 0, tok.all_special_ids

    def decode(self, ids, **kw):
        self.ids += len(ids)
        return self.tok.decode(ids, **kw)


def test_work_per_push_is_bounded(demo):
    ids = _random_ids(random.Random(2), demo, 2000, _byte_tokens(demo))
    counting = _Counting(demo)
    stream, out = TextStream(counting, stop=("never there", "\n\n\n\n")), []
    for i in range(0, len(ids), 3):
        out.append(stream.push(ids[i : i + 3]).text)
    assert "".join(out) + stream.flush().text == demo.decode(ids, **KW)
    assert counting.ids < 30 * len(ids)  # re-decoding everything each push: about 670,000
