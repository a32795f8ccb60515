"""The executors' index of remembered ids (``checkpoint.seen``) against a plain-Python oracle: random
manifests as a stream's batches, merges, expiries, replays and restores change them."""

import random

import numpy as np

from streaming.checkpoint.seen import Index


def _oracle(files: dict[str, list[tuple[int, int, int]]], live: list[str], h1, h2, watermark: int) -> list[bool]:
    held = {(a, b) for token in live for a, b, expires in files[token] if expires > watermark}
    return [(a, b) in held for a, b in zip(h1, h2)]


def test_the_index_answers_like_a_set_of_the_live_files_unexpired_ids_under_random_manifest_changes():
    rng = random.Random(7)
    for scenario in range(60):
        files: dict[str, list[tuple[int, int, int]]] = {}  # token -> (h1, h2, expires)
        universe = [(rng.getrandbits(63) - (1 << 62), rng.getrandbits(63)) for _ in range(400)]
        universe += [(universe[0][0], rng.getrandbits(63))]  # two ids with one first hash (a collision)
        live: list[str] = []
        history: list[list[str]] = []
        index = Index()
        reads = []

        def read(token):
            reads.append(token)
            rows = files[token]
            return (np.array([r[0] for r in rows], dtype=np.int64), np.array([r[1] for r in rows], dtype=np.int64),
                    np.array([r[2] for r in rows], dtype=np.int64))

        for step in range(40):
            op = rng.random()
            if op < 0.5 or not live:  # a batch writes its ids
                token = f"s{scenario}b{step}"
                files[token] = [(*rng.choice(universe), rng.randrange(0, 100)) for _ in range(rng.randrange(0, 30))]
                live = [*live, token]
            elif op < 0.65 and len(live) > 1:  # a merge of some files into one (same ids)
                merged = rng.sample(live, k=rng.randint(2, len(live)))
                token = f"s{scenario}m{step}"
                files[token] = [r for t in merged for r in files[t]]
                live = [t for t in live if t not in merged] + [token]
            elif op < 0.8:  # files whose ids all expired are dropped
                live = [t for t in live if rng.random() < 0.8]
            elif op < 0.9 and history:  # a restore (or a replay): an earlier manifest
                live = list(rng.choice(history))
            history.append(list(live))
            got_live = index.update([(t, t) for t in live], read)
            watermark = rng.randrange(0, 100)
            asked = [rng.choice(universe) for _ in range(50)] + [(rng.getrandbits(62), rng.getrandbits(62))]
            h1 = np.array([a for a, _ in asked], dtype=np.int64)
            h2 = np.array([b for _, b in asked], dtype=np.int64)
            found = index.remembered(h1, h2, watermark, got_live)
            assert found.tolist() == _oracle(files, live, h1, h2, watermark), (scenario, step)
            sizes = [len(r) for r in index.runs]
            assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes  # geometric: log2(entries) runs at most
            assert index.entries <= 2 * sum(len(files[t]) for t in live) + max(len(v) for v in files.values())


def test_a_file_dropped_from_the_index_and_asked_for_again_is_read_again():
    index = Index()
    content = {"a": ([1, 2], [10, 20], [99, 99]), "b": ([3], [30], [99])}
    read = lambda token: tuple(np.array(v, dtype=np.int64) for v in content[token])  # noqa: E731
    live = index.update([("a", "a"), ("b", "b")], read)
    assert index.remembered(np.array([1, 3]), np.array([10, 30]), 0, live).tolist() == [True, True]
    live = index.update([("b", "b")], read)  # a's entries are as many as b's live ones: dropped
    assert index.remembered(np.array([1, 3]), np.array([10, 30]), 0, live).tolist() == [False, True]
    live = index.update([("a", "a"), ("b", "b")], read)  # a restore brings it back
    assert index.remembered(np.array([1, 3]), np.array([10, 30]), 0, live).tolist() == [True, True]
    assert index.remembered(np.array([1]), np.array([11]), 0, live).tolist() == [False]  # the second hash decides
    assert index.remembered(np.array([1]), np.array([10]), 99, live).tolist() == [False]  # forgotten at 99
