"""Image-text evaluation: MMVP pair metric, stage-mean similarity, zero-shot, caption recall,
the synthetic MMVP set and the MMVP-VLM loader (on a tiny fake download)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import raycl.eval.image_text as image_text
from raycl.data.sources.captions import CAPTION_ORDER, WORDS, describe
from raycl.eval.image_text import (
    caption_recall,
    image_text_similarity,
    mmvp_pair_correct,
    mmvp_scores,
    pattern_slug,
    zero_shot_accuracy,
)
from raycl.eval.mmvp import MMVPSet, load_mmvp_vlm, synthetic_mmvp
from raycl.kmeans import l2_normalize

# ---------------------------------------------------------------------------- MMVP pair metric

# Pair 0: both directions right. Pair 1: every statement picks its image (column-wise), but
# image 3 prefers statement 2 (row-wise): right text->image, wrong image->text. The 9s outside
# the 2x2 pair blocks must be ignored.
SIM_4 = np.array([
    [0.9, 0.3, 9.0, 9.0],
    [0.2, 0.8, 9.0, 9.0],
    [9.0, 9.0, 0.7, 0.4],
    [9.0, 9.0, 0.6, 0.5],
])


def test_pair_metric_both_directions_on_a_4x4_matrix() -> None:
    assert mmvp_pair_correct(SIM_4).tolist() == [True, True]
    assert mmvp_pair_correct(SIM_4, "text_to_image").tolist() == [True, True]
    assert mmvp_pair_correct(SIM_4, "image_to_text").tolist() == [True, False]


def test_pair_metric_ties_are_wrong() -> None:
    # Row tie (image 0 scores both statements 0.5): wrong image->text, fine text->image.
    row_tie = np.array([[0.5, 0.5], [0.1, 0.9]])
    assert mmvp_pair_correct(row_tie, "image_to_text").tolist() == [False]
    assert mmvp_pair_correct(row_tie, "text_to_image").tolist() == [True]
    # Column tie (statement 0 scores both images 0.5): the reverse.
    column_tie = np.array([[0.5, 0.2], [0.5, 0.9]])
    assert mmvp_pair_correct(column_tie, "text_to_image").tolist() == [False]
    assert mmvp_pair_correct(column_tie, "image_to_text").tolist() == [True]
    assert mmvp_pair_correct(np.full((2, 2), 0.3), "image_to_text").tolist() == [False]
    assert mmvp_pair_correct(np.full((2, 2), 0.3), "text_to_image").tolist() == [False]


def test_mmvp_scores_per_pattern_and_macro_mean_on_a_6x6_matrix() -> None:
    sim = np.zeros((6, 6))
    sim[0:2, 0:2] = [[0.9, 0.1], [0.2, 0.8]]  # right either way
    sim[2:4, 2:4] = [[0.3, 0.6], [0.7, 0.4]]  # swapped: wrong either way
    sim[4:6, 4:6] = [[0.7, 0.4], [0.6, 0.5]]  # right text->image, wrong image->text
    patterns = ["Color and Appearance", "Color and Appearance", "Texts"]
    # Macro mean: (1/2 + 1) / 2 = 0.75, not the 2/3 of pairs solved.
    assert mmvp_scores(sim, patterns) == {"color_and_appearance": 0.5, "texts": 1.0,
                                          "mean": 0.75}
    assert mmvp_scores(sim, patterns, direction="image_to_text") == {
        "color_and_appearance": 0.5, "texts": 0.0, "mean": 0.25}
    assert mmvp_scores(sim, np.array(patterns)) == mmvp_scores(sim, patterns)


def test_pattern_slugs() -> None:
    assert pattern_slug("Orientation and Direction") == "orientation_and_direction"
    assert pattern_slug("Camera_Perspective") == "camera_perspective"
    assert pattern_slug("S&C (state)") == "s_c_state"
    with pytest.raises(ValueError, match="no letters"):
        pattern_slug("&&")


@pytest.mark.parametrize("bad", [np.zeros((3, 3)), np.zeros((2, 4)), np.zeros(4),
                                 np.zeros((0, 0)), np.array([[np.nan, 0.0], [0.0, 1.0]])])
def test_pair_metric_rejects_bad_matrices(bad: np.ndarray) -> None:
    with pytest.raises(ValueError):
        mmvp_pair_correct(bad)


def test_mmvp_scores_rejects_bad_patterns() -> None:
    with pytest.raises(ValueError, match="2 pairs"):
        mmvp_scores(SIM_4, ["a"])
    with pytest.raises(ValueError, match="share the key"):
        mmvp_scores(SIM_4, ["Color", "color"])
    with pytest.raises(ValueError, match="'mean'"):
        mmvp_scores(SIM_4, ["Mean", "x"])
    with pytest.raises(ValueError, match="direction"):
        mmvp_pair_correct(SIM_4, "both")


# ------------------------------------------------------------------- stage-mean similarity


def test_one_stage_is_plain_cosine() -> None:
    image = np.array([[3.0, 4.0], [0.0, -2.0]])
    text = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    expected = np.array([[0.6, 7 / (5 * np.sqrt(2)), 0.0],
                         [0.0, -1 / np.sqrt(2), 0.0]])  # the zero text row scores 0
    sim = image_text_similarity(image, text)
    assert sim.dtype == np.float32 and sim.shape == (2, 3)
    np.testing.assert_allclose(sim, expected, atol=1e-6)


def test_two_stages_average_the_per_stage_cosines() -> None:
    a, b = np.array([3.0, 4.0]), np.array([1.0, 0.0])
    # MCL integration: each stage L2-normalised, concatenated, the whole row normalised again.
    row = l2_normalize(np.concatenate([a / 5.0, b])[None, :])
    text = np.array([[0.0, 1.0], [2.0, 2.0]])
    # Stage cosines with [0, 1]: 0.8 and 0. With [1, 1]/sqrt 2: 7/(5 sqrt 2) and 1/sqrt 2.
    expected = [[(0.8 + 0.0) / 2, (7 / (5 * np.sqrt(2)) + 1 / np.sqrt(2)) / 2]]
    np.testing.assert_allclose(image_text_similarity(row, text), expected, atol=1e-6)
    # The scale of each block does not matter: it is normalised per stage.
    raw = np.concatenate([a, 7.0 * b])[None, :]
    np.testing.assert_allclose(image_text_similarity(raw, text), expected, atol=1e-6)


def test_stage_mean_matches_cosine_with_a_repeated_text_row() -> None:
    rng = np.random.default_rng(0)
    stages, dim = 3, 5
    blocks = [l2_normalize(rng.normal(size=(7, dim))) for _ in range(stages)]
    images = l2_normalize(np.concatenate(blocks, axis=1))
    texts = rng.normal(size=(4, dim))
    mean_of_cosines = np.mean([block @ l2_normalize(texts).T for block in blocks], axis=0)
    repeated = l2_normalize(np.tile(texts, (1, stages)))
    np.testing.assert_allclose(image_text_similarity(images, texts), mean_of_cosines, atol=1e-6)
    np.testing.assert_allclose(images @ repeated.T, mean_of_cosines, atol=1e-6)


def test_similarity_rejects_bad_widths_and_values() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        image_text_similarity(np.ones((2, 5)), np.ones((3, 2)))
    with pytest.raises(ValueError, match="not a multiple"):
        image_text_similarity(np.ones((2, 2)), np.ones((3, 4)))
    with pytest.raises(ValueError, match="2-D"):
        image_text_similarity(np.ones(4), np.ones((3, 2)))
    with pytest.raises(ValueError, match="finite"):
        image_text_similarity(np.array([[np.inf, 0.0]]), np.ones((3, 2)))
    with pytest.raises(ValueError, match="at least one column"):
        image_text_similarity(np.ones((2, 0)), np.ones((3, 0)))


# ------------------------------------------------------------------------------ zero-shot


def test_zero_shot_accuracy_on_a_toy_case() -> None:
    images = np.array([[1.0, 0.0], [0.0, 1.0], [0.8, 0.6], [-1.0, 0.1]])
    prompts = {
        "color": np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]),
        "shape": np.array([[1.0, 1.0], [1.0, -1.0]]),
        "unused": np.array([[1.0, 0.0]]),
    }
    # Predictions: color 0, 1, 0, 2 (3 of 4 right); shape 0 (tie: lower index), 0, 0, 0
    # -> 2 of 4 right (images 0 and 3 are class 0).
    labels = {"color": np.array([0, 1, 1, 2]), "shape": np.array([0, 1, 1, 0])}
    scores = zero_shot_accuracy(images, labels, prompts)
    assert scores == pytest.approx({"color": 0.75, "shape": 0.5, "mean": 0.625})
    assert list(scores) == ["color", "shape", "mean"]
    # Stage-concatenated image features go through the stage-mean similarity.
    doubled = np.concatenate([images, images], axis=1)
    assert zero_shot_accuracy(doubled, labels, prompts) == pytest.approx(scores)


def test_zero_shot_rejects_bad_inputs() -> None:
    images = np.eye(2)
    prompts = {"color": np.eye(2)}
    with pytest.raises(ValueError, match="no class prompt"):
        zero_shot_accuracy(images, {"shape": np.array([0, 1])}, prompts)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        zero_shot_accuracy(images, {"color": np.array([0, 2])}, prompts)
    with pytest.raises(ValueError, match="integers"):
        zero_shot_accuracy(images, {"color": np.array([0, 1, 1])}, prompts)
    with pytest.raises(ValueError, match="at least one"):
        zero_shot_accuracy(images, {}, prompts)


# --------------------------------------------------------------------------- caption recall

# 4 images, 3 distinct captions ("a" twice). Caption features are one-hot per string.
RECALL_CAPTIONS = ["a", "b", "a", "c"]
RECALL_TEXT = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
RECALL_IMAGES = np.array([
    [0.1, 1.0, 0.0],  # own "a"; "b" ranks first, then the two "a" captions
    [0.0, 1.0, 0.2],  # own "b"; first
    [1.0, 0.0, 0.0],  # own "a"; both "a" captions first (the other image's counts too)
    [0.8, 0.0, 0.6],  # own "c"; behind both "a" captions
])


def test_caption_recall_with_duplicate_captions_by_hand() -> None:
    scores = caption_recall(RECALL_IMAGES, RECALL_CAPTIONS, RECALL_TEXT, ks=(1, 2, 3, 10))
    # i2t: images 1 and 2 hit at 1; image 0 at 2; image 3 at 3.
    # t2i: caption 0 / 2 ("a") -> image 2 first (an "a" image): hit. Caption 1 ("b") -> image 0
    # (0.995) before image 1 (0.98): hit at 2. Caption 3 ("c") -> image 3 first: hit.
    assert scores == pytest.approx({
        "i2t_r1": 2 / 4, "i2t_r2": 3 / 4, "i2t_r3": 1.0, "i2t_r10": 1.0,
        "t2i_r1": 3 / 4, "t2i_r2": 1.0, "t2i_r3": 1.0, "t2i_r10": 1.0,
    })
    assert list(caption_recall(RECALL_IMAGES, RECALL_CAPTIONS, RECALL_TEXT)) == [
        "i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10"]


def test_caption_recall_counts_ties_against_the_query() -> None:
    # Image 0 scores its own caption and the other one equally: a miss at 1, a hit at 2.
    images = np.array([[1.0, 1.0], [0.0, 1.0]])
    texts = np.array([[1.0, 0.0], [0.0, 1.0]])
    scores = caption_recall(images, ["x", "y"], texts, ks=(1, 2))
    assert scores["i2t_r1"] == 0.5 and scores["i2t_r2"] == 1.0


def _recall_by_sorting(sim: np.ndarray, query_codes: np.ndarray, item_codes: np.ndarray,
                       k: int) -> float:
    """Reference: sort each row (score descending, positives after equal non-positives)."""
    hits = []
    for row, code in zip(sim, query_codes, strict=True):
        positive = item_codes == code
        order = np.lexsort((positive, -row))
        hits.append(positive[order[:k]].any())
    return float(np.mean(hits))


def test_caption_recall_matches_a_sorting_reference_in_small_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(1)
    num, dim = 40, 4
    images = rng.normal(size=(num, 2 * dim))
    texts_by_string = rng.normal(size=(6, dim))
    codes = rng.integers(0, 6, size=num)
    captions = [f"caption {code}" for code in codes]
    texts = texts_by_string[codes]
    sim = image_text_similarity(images, texts)
    expected = {}
    for k in (1, 3, 10):
        expected[f"i2t_r{k}"] = _recall_by_sorting(sim, codes, codes, k)
        expected[f"t2i_r{k}"] = _recall_by_sorting(sim.T, codes, codes, k)
    full = caption_recall(images, captions, texts, ks=(1, 3, 10))
    monkeypatch.setattr(image_text, "CHUNK_PAIRS", 7 * num)  # chunks of 7 queries
    chunked = caption_recall(images, captions, texts, ks=(1, 3, 10))
    assert full == pytest.approx(expected)
    assert chunked == full


def test_caption_recall_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="one row per image"):
        caption_recall(RECALL_IMAGES, RECALL_CAPTIONS[:3], RECALL_TEXT)
    with pytest.raises(ValueError, match="one row per image"):
        caption_recall(RECALL_IMAGES, RECALL_CAPTIONS, RECALL_TEXT[:3])
    with pytest.raises(ValueError, match="ks"):
        caption_recall(RECALL_IMAGES, RECALL_CAPTIONS, RECALL_TEXT, ks=(0,))
    with pytest.raises(ValueError, match="distinct"):
        caption_recall(RECALL_IMAGES, RECALL_CAPTIONS, RECALL_TEXT, ks=(1, 1))
    with pytest.raises(ValueError, match="not a multiple"):
        caption_recall(RECALL_IMAGES[:, :2], RECALL_CAPTIONS, RECALL_TEXT)


# --------------------------------------------------------------------------- synthetic MMVP

_CLASS_OF = {name: {word: index for index, word in enumerate(WORDS[name])}
             for name in CAPTION_ORDER}


def _labels_of(statement: str) -> dict[str, int]:
    """Invert ``describe(labels, CAPTION_ORDER)``: "a <colour> <texture> <shape>"."""
    _, color, texture, shape = statement.split(" ", 3)
    return {"color": _CLASS_OF["color"][color], "texture": _CLASS_OF["texture"][texture],
            "shape": _CLASS_OF["shape"][shape]}


def test_synthetic_mmvp_pairs_differ_in_exactly_the_named_attribute() -> None:
    mmvp = synthetic_mmvp(pairs_per_attribute=4, resolution=32, seed=3)
    assert isinstance(mmvp, MMVPSet) and mmvp.num_pairs == 12
    assert mmvp.images.shape == (24, 3, 32, 32) and mmvp.images.dtype == np.uint8
    assert mmvp.statements.shape == (24,) and mmvp.patterns.shape == (12,)
    assert mmvp.patterns.tolist() == ["color"] * 4 + ["texture"] * 4 + ["shape"] * 4
    for pair, pattern in enumerate(mmvp.patterns):
        first, second = (_labels_of(str(s)) for s in mmvp.statements[2 * pair: 2 * pair + 2])
        assert mmvp.statements[2 * pair] == describe(first, CAPTION_ORDER)
        assert [name for name in CAPTION_ORDER if first[name] != second[name]] == [pattern]
        image_a, image_b = mmvp.images[2 * pair], mmvp.images[2 * pair + 1]
        assert not np.array_equal(image_a, image_b)
        if pattern in ("color", "texture"):
            # Same shape and pose: the object covers exactly the same pixels.
            np.testing.assert_array_equal(image_a.max(axis=0) > 0, image_b.max(axis=0) > 0)


def test_synthetic_mmvp_is_deterministic_per_seed() -> None:
    first = synthetic_mmvp(pairs_per_attribute=2, resolution=16, seed=7)
    again = synthetic_mmvp(pairs_per_attribute=2, resolution=16, seed=7)
    other = synthetic_mmvp(pairs_per_attribute=2, resolution=16, seed=8)
    np.testing.assert_array_equal(first.images, again.images)
    np.testing.assert_array_equal(first.statements, again.statements)
    assert not np.array_equal(first.images, other.images)
    assert first.statements.tolist() != other.statements.tolist()


def test_synthetic_mmvp_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="pairs_per_attribute"):
        synthetic_mmvp(pairs_per_attribute=0, resolution=16, seed=0)
    with pytest.raises(ValueError, match="resolution"):
        synthetic_mmvp(pairs_per_attribute=1, resolution=0, seed=0)


# ------------------------------------------------------------------------ MMVP-VLM loader

# A fake download in the real layout: root/Questions.csv and root/MLLM_VLM Images/<Type>/<id>.jpg.
FAKE_ROWS = [
    (1, "Orientation", "The dog's head is facing left"),
    (2, "Orientation", "The dog's head is facing right"),
    (3, "Color", "The flower is red"),
    (4, "Color", "The flower is yellow"),
]
# The middle (kept) colour of each image; the side bands are cropped away.
MIDDLE = {1: (200, 30, 30), 2: (30, 200, 30), 3: (30, 30, 200), 4: (128, 128, 128)}


def _write_fake_mmvp_vlm(root: Path) -> None:
    with (root / "Questions.csv").open("w", newline="") as handle:
        handle.write("Question ID,Type,Statement\n")
        for qid, kind, statement in FAKE_ROWS:
            handle.write(f'{qid},{kind},"{statement}"\n')
    for qid, kind, _ in FAKE_ROWS:
        folder = root / "MLLM_VLM Images" / kind
        folder.mkdir(parents=True, exist_ok=True)
        # Landscape (odd ids) or portrait (even ids), three bands of 24 px along the long side.
        bands = np.zeros((24, 72, 3), dtype=np.uint8)
        bands[:, :24], bands[:, 24:48], bands[:, 48:] = (255, 255, 0), MIDDLE[qid], (0, 0, 0)
        pixels = bands if qid % 2 else bands.transpose(1, 0, 2)
        image = Image.fromarray(pixels)
        if qid == 4:
            image = image.convert("L")  # a grayscale file must come back as RGB
        image.save(folder / f"{qid}.jpg", quality=95, subsampling=0)


def test_load_mmvp_vlm_reads_the_real_layout(tmp_path: Path) -> None:
    _write_fake_mmvp_vlm(tmp_path)
    mmvp = load_mmvp_vlm(tmp_path, resolution=8)
    assert mmvp is not None
    assert mmvp.images.shape == (4, 3, 8, 8) and mmvp.images.dtype == np.uint8
    assert mmvp.patterns.tolist() == ["Orientation", "Color"]
    assert mmvp.statements.tolist() == [f"a photo of {s}" for _, _, s in FAKE_ROWS]
    for row, qid in enumerate((1, 2, 3, 4)):
        # Centre crop keeps only the middle band (JPEG leaves a little noise).
        colour = np.array(MIDDLE[qid], dtype=float)
        if qid == 4:
            colour = np.full(3, 128.0)
        assert np.abs(mmvp.images[row].astype(float) - colour[:, None, None]).max() <= 12
    raw = load_mmvp_vlm(str(tmp_path), resolution=8, prompt_prefix="")
    assert raw is not None and raw.statements.tolist() == [s for _, _, s in FAKE_ROWS]
    assert load_mmvp_vlm(tmp_path, resolution=8, check_only=True) is None


def test_load_mmvp_vlm_rejects_an_unreadable_image(tmp_path: Path) -> None:
    _write_fake_mmvp_vlm(tmp_path)
    broken = tmp_path / "MLLM_VLM Images" / "Color" / "4.jpg"
    broken.write_bytes(b"not a jpeg")
    assert load_mmvp_vlm(tmp_path, resolution=8, check_only=True) is None  # files only
    with pytest.raises(ValueError, match=r"cannot read .*4\.jpg"):
        load_mmvp_vlm(tmp_path, resolution=8)


def test_load_mmvp_vlm_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        load_mmvp_vlm(tmp_path / "absent", resolution=8)
    with pytest.raises(ValueError, match=r"Questions\.csv"):
        load_mmvp_vlm(tmp_path, resolution=8)
    _write_fake_mmvp_vlm(tmp_path)
    (tmp_path / "MLLM_VLM Images" / "Color" / "3.jpg").unlink()
    for check_only in (False, True):
        with pytest.raises(ValueError, match=r"Color[/\\]3\.jpg"):
            load_mmvp_vlm(tmp_path, resolution=8, check_only=check_only)
    (tmp_path / "MLLM_VLM Images" / "Color").rename(tmp_path / "moved")
    (tmp_path / "MLLM_VLM Images" / "Orientation").rename(tmp_path / "moved2")
    (tmp_path / "MLLM_VLM Images").rmdir()
    with pytest.raises(ValueError, match="MLLM_VLM Images"):
        load_mmvp_vlm(tmp_path, resolution=8)


@pytest.mark.parametrize("rows, message", [
    ("1,Color,a\n", "even"),
    ("2,Color,a\n1,Color,b\n", "not a pair"),
    ("1,Color,a\n2,Texts,b\n", "not a pair"),
    ("x,Color,a\n2,Color,b\n", "not an integer"),
    ("1,Color\n2,Color,b\n", "3 columns"),
])
def test_load_mmvp_vlm_rejects_malformed_questions(tmp_path: Path, rows: str,
                                                   message: str) -> None:
    (tmp_path / "MLLM_VLM Images").mkdir()
    (tmp_path / "Questions.csv").write_text("Question ID,Type,Statement\n" + rows)
    with pytest.raises(ValueError, match=message):
        load_mmvp_vlm(tmp_path, resolution=8)
