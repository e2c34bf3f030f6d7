import re
from collections import Counter
from typing import Dict, Iterable, List, Tuple

WORD = re.compile(r"[A-Za-z']+")
SENTENCE_END = re.compile(r"[.!?]+(?:\s|$)")


def words(text: str) -> List[str]:
    """The words of `text`, lower-cased, apostrophes kept."""
    return [w.lower().strip("'") for w in WORD.findall(text) if w.strip("'")]


def word_counts(text: str) -> Counter:
    """How often each word occurs in `text`."""
    return Counter(words(text))


def top_words(text: str, n: int = 10) -> List[Tuple[str, int]]:
    """The `n` most frequent words, ties broken alphabetically."""
    counts = word_counts(text)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def sentences(text: str) -> List[str]:
    parts = SENTENCE_END.split(text)
    return [p.strip() for p in parts if p.strip()]


def average_sentence_length(text: str) -> float:
    found = sentences(text)
    if not found:
        return 0.0
    return sum(len(words(s)) for s in found) / len(found)


def lexical_density(text: str) -> float:
    """Distinct words over all words (0 for empty text)."""
    all_words = words(text)
    return len(set(all_words)) / len(all_words) if all_words else 0.0


def summary(text: str) -> Dict[str, object]:
    return {
        "words": len(words(text)),
        "sentences": len(sentences(text)),
        "average_sentence_length": round(average_sentence_length(text), 2),
        "lexical_density": round(lexical_density(text), 3),
        "top_words": top_words(text, 5),
    }


def merge_counts(texts: Iterable[str]) -> Counter:
    total: Counter = Counter()
    for text in texts:
        total.update(word_counts(text))
    return total


if __name__ == "__main__":
    import sys

    print(summary(sys.stdin.read()))
