"""Context segmentation time vs size (issue 11: a 56 KB paragraph took 16 s and grew super-linearly).

    .venv/bin/python bench/segment_bench.py

Drives `spark_jobs.conversations.sentences.split_units`, the function enrich's normaliser calls per turn, on one
paragraph of prose (abbreviations, decimals, initials) and on mixed structured text (code fences,
JSON, tables, lists), 64 KB and 1 MB; best of 3 per size. Target: 1 MB / 64 KB time ratio <= 20x
(16x is linear).
"""

from __future__ import annotations

import time

from spark_jobs.conversations.sentences import split_units

PROSE = "The museum opens at 10 a.m. on Sundays. Dr. Smith, e.g. the curator, walked 3.5 km! Is it far? Yes. "
MIXED = ("Intro text. More text!\n```python\ndef f(x):\n    return x\n```\n| a | b |\n| 1 | 2 |\n- item one. Still one.\n"
         '  continued\n{"k": [1, 2, {"v": "x}"}]}\nClosing prose line.\n')


def best(text: str, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        split_units(text)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    for name, unit in (("prose paragraph", PROSE), ("mixed structured", MIXED)):
        small = (unit * (65536 // len(unit) + 1))[:65536]
        large = (unit * ((1 << 20) // len(unit) + 1))[: 1 << 20]
        ts, tl = best(small), best(large)
        print(f"{name}: 64 KB {ts * 1e3:.1f} ms, 1 MB {tl * 1e3:.1f} ms, ratio {tl / ts:.1f}x (linear = 16x)")


if __name__ == "__main__":
    main()
