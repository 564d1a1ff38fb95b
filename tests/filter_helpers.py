"""The crafted records of the filter tests and what each must become; built into committed enriched
artifacts with samples/enriched.py."""

from __future__ import annotations

import functools

from samples.enriched import Rec, enriched_table

LONG_ANSWER = (
    "Water evaporates from oceans, lakes and rivers when the sun heats it. The vapour rises, cools and condenses "
    "into clouds made of tiny droplets. When the droplets merge and grow heavy they fall as rain, snow, sleet or "
    "hail. Some of that water soaks into the ground and refills aquifers, some runs off into streams and rivers, "
    "and plants return part of it to the air through transpiration. The cycle then starts again, moving water "
    "between the sea, the air and the land without end."
)
ROME_ANSWER = (
    "After a century of civil wars between ambitious generals, the Republic's institutions could no longer contain "
    "the armies that were loyal to their commanders rather than to the Senate. Julius Caesar crossed the Rubicon in "
    "49 BC, defeated Pompey and was named dictator for life, and his assassination in 44 BC did not restore the old "
    "order. His adopted heir Octavian defeated Mark Antony and Cleopatra at Actium in 31 BC, and in 27 BC the Senate "
    "granted him the name Augustus. He kept the forms of the Republic, the consuls, the Senate and the assemblies, "
    "but held the real power himself through his command of the legions, his control of the provinces and the "
    "treasury, and a vast network of clients. Historians therefore date the beginning of the Roman Empire to his "
    "reign, even though Romans of the time still spoke of the res publica for generations afterwards."
)

# Crafted records: what each must become is asserted in test_filter_stage.py.
KEEP = [
    Rec("k-france", "What is the capital of France?", "The capital of France is Paris.",
        relevant=["France is a country in Western Europe.", "Its government sits in Paris."]),
    Rec("k-germany", "What is the capital of Germany?", "The capital of Germany is Berlin."),
    Rec("k-reverse", "How do I reverse a list in Python?",
        "Use slicing: my_list[::-1] returns a reversed copy, or call my_list.reverse() to reverse in place.", category="code"),
    Rec("k-sort", "How do I sort a list in Python?",
        "Use sorted(my_list) to get a new sorted list, or my_list.sort() to sort in place.", category="code"),
    Rec("k-solve1", "Solve 2x + 3 = 11.", "Subtract 3 from both sides to get 2x = 8, then divide by 2: x = 4.", category="math"),
    Rec("k-solve2", "Solve 3x - 5 = 10.", "Add 5 to both sides to get 3x = 15, then divide by 3: x = 5.", category="math"),
    Rec("k-seasons", "What causes the seasons on Earth?",
        "The tilt of Earth's axis: each hemisphere leans towards the sun for part of the year and away from it for the rest.",
        reasoning_trace="The question is about seasons. The key fact is axial tilt, not distance from the sun.", category="stem"),
    Rec("k-photo", "What is photosynthesis?",
        "Photosynthesis is the process by which plants use sunlight, water and carbon dioxide to make glucose and oxygen.",
        category="stem"),
    Rec("k-hashmap", "Explain what a hash map is.",
        "A hash map stores key-value pairs in an array of buckets and uses a hash of the key to find the bucket, "
        "so lookups take constant time on average.", category="code"),
    Rec("k-austen", "Who wrote Pride and Prejudice?", "Jane Austen wrote Pride and Prejudice, published in 1813."),
    Rec("k-spider", "How many legs does a spider have?", "A spider has eight legs."),
    Rec("k-boil", "What is the boiling point of water at sea level?",
        "Water boils at 100 degrees Celsius, or 212 degrees Fahrenheit, at sea level.", category="stem"),
    Rec("k-tool", "What is the weather in Paris right now?", "It is 18 degrees Celsius and sunny in Paris right now.",
        relevant=["get_weather(city='Paris') returned: 18C, sunny."], category="tool_calling"),
]
# Paraphrases of KEEP records: exactly one of each pair survives (the smaller key).
NEAR = {
    # same context as k-france: near duplicates are searched among records of one context (filter_rows.context_key)
    "n-france": ("k-france", Rec("n-france", "Which city is the capital of France?", "Paris is the capital city of France.",
                                 relevant=["France is a country in Western Europe.", "Its government sits in Paris."])),
    "n-reverse": ("k-reverse", Rec("n-reverse", "What is the way to reverse a Python list?",
                                   "You can use slicing, my_list[::-1], which returns a reversed copy, or my_list.reverse() "
                                   "which reverses it in place.", category="code")),
    "n-solve1": ("k-solve1", Rec("n-solve1", "Solve for x: 2x + 3 = 11",
                                 "Subtracting 3 gives 2x = 8; dividing by 2 gives x = 4.", category="math")),
}
EXACT = Rec("e-austen", "who wrote   Pride and Prejudice? ", "Jane Austen wrote Pride and Prejudice,  published in 1813.")
REJECT = {
    "x-mismatch": ("low_qa_similarity", Rec("x-mismatch", "What is the capital of Italy?",
                                            "Mitochondria produce ATP through cellular respiration.")),
    "x-empty": ("missing_field", Rec("x-empty", "What is the tallest mountain?", "  ")),
    "x-noemb": ("missing_field", Rec("x-noemb", "What is the largest ocean?", "The Pacific Ocean is the largest.",
                                     drop_question_embedding=True)),
    "x-long": ("too_long", Rec("x-long", "How did the Roman Republic become an empire?", ROME_ANSWER)),
    "x-seq": ("exceeds_seq_len", Rec("x-seq", "Describe the water cycle.", LONG_ANSWER, category="stem")),
    "x-short": ("answer_too_short", Rec("x-short", "Which planet is known as the Red Planet?", "Mars.")),
}
FILTER_SETTINGS = {"seq_len": 128, "max_tokens": 160, "min_answer_tokens": 3, "val_fraction": 0.3,
                   "near_dup_threshold": 0.9, "min_qa_similarity": 0.2, "overflow": "reject", "shard_tokens": 1024}


def crafted_records() -> list[Rec]:
    return [*KEEP, *(r for _, r in NEAR.values()), EXACT, *(r for _, r in REJECT.values())]


@functools.lru_cache(maxsize=1)
def crafted_table():
    """The crafted records as an enriched table (embedded once per test session)."""
    return enriched_table(crafted_records())
