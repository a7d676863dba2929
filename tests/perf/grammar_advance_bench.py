"""The host cost of a structured step's grammar check, one way against another (device tool
helper, not a test; CPU only): SmolLM2's tokenizer, 64 matchers of the structured bench's
schema walking an indented JSON text, per step: `try_consume` one row at a time (the old
check), `Grammars.advance` (consume_token one row at a time) and llguidance's executor
(consume_token_par, in parallel without the GIL), and the first masks of 64 new requests
(`Grammars.masks`, their template's mask computed once).

    python3 tests/perf/grammar_advance_bench.py [ROWS] [STEPS]   (default 64 200)
"""

from __future__ import annotations

import json
import sys
import time

from taipan.bench.structured import array_schema
from taipan.models import resolve
from taipan.ops.grammar import Grammars, GrammarSpec
from taipan.ops.tokenizer import Tokenizer


def main(rows: int, steps: int) -> None:
    tok = Tokenizer.from_gguf(resolve("smollm2")[1])
    spec = GrammarSpec("json_schema", array_schema(128))
    items = [f"note number {i} about the text" for i in range(steps)]
    text = json.dumps({"notes": items}, indent=4)
    ids = tok.encode(text)[: 3 * steps]
    rids = list(range(rows))

    def fresh() -> Grammars:
        g = Grammars(tok, 49152)
        for r in rids:
            g.start(r, spec)
        return g

    g = fresh()
    start = time.perf_counter()
    for t in ids[:steps]:
        assert all(g.try_consume(r, t) for r in rids)
    one = (time.perf_counter() - start) / steps
    g = fresh()
    start = time.perf_counter()
    for t in ids[:steps]:
        assert g.advance(rids, [t] * rows).all()
    print(f"{'advance':24s} {1e3 * (time.perf_counter() - start) / steps:.3f} ms a step")
    g = fresh()
    start = time.perf_counter()
    for t in ids[:steps]:  # (llguidance's executor: in parallel, without the GIL)
        assert all(g.executor.consume_token_par([(g.matchers[r], t) for r in rids]))
    print(f"{'consume_token_par':24s} {1e3 * (time.perf_counter() - start) / steps:.3f} ms a step")
    print(f"{'try_consume each row':24s} {1e3 * one:.3f} ms a step ({rows} rows)")
    g = Grammars(tok, 49152)
    g.start(10_000, spec)  # (the template compiled)
    for r in rids:
        g.start(r, spec)
    start = time.perf_counter()
    g.masks(rids)
    print(f"first masks of {rows} new requests: {1e3 * (time.perf_counter() - start):.3f} ms")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]) if a else 64, int(a[1]) if len(a) > 1 else 200)
