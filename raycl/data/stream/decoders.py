"""The functions Ray Data runs in stream mode's decoder processes, in a module of their own.

Ray pickles a module-level function by reference: each decoder process imports the module that
defines it, and everything that module imports. Defined beside the training loader
(:mod:`raycl.worker.stream_loader`, which imports torch, faiss and the samplers) they cost each
decoder process about 3.7 s and 600 MB before its first image (issue 33). This module imports
numpy and raycl's decoding only: no torch, no faiss, no Ray (a test imports it in a fresh
interpreter and looks at ``sys.modules``).

Image-text runs tokenise their captions here too (:class:`CaptionTokenizer`), in the decoders
rather than in the training thread every step; that tokenizer is open_clip's, which loads
open_clip (and torch) in the decoder processes of those runs only, once per process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raycl.data.stream.files import decode_batch
from raycl.data.stream.shards import Shard, ShardFormat, shard_chunks_as_columns


@dataclass
class CaptionTokenizer:
    """open_clip's bundled BPE tokenizer (``SimpleTokenizer``) as numpy, made where it is first
    called: the decoders pickle only ``context_length``, not the vocabulary. It gives the tokens
    of :meth:`raycl.methods.clip.CLIP.tokenize` (the same class and context length).

    Args:
        context_length: tokens per caption (the text tower's ``context_length``).
    """

    context_length: int
    _tokenizer: Any = field(default=None, init=False, repr=False, compare=False)

    def __call__(self, texts: list[str]) -> np.ndarray:
        """int64 (N, ``context_length``) tokens of ``texts``."""
        if self._tokenizer is None:
            from open_clip.tokenizer import SimpleTokenizer

            self._tokenizer = SimpleTokenizer(context_length=self.context_length)
        return self._tokenizer(list(texts)).long().numpy()

    def __getstate__(self) -> dict[str, Any]:
        return {"context_length": self.context_length}  # never the loaded vocabulary

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.context_length, self._tokenizer = int(state["context_length"]), None


def decode_file_batch(batch: dict[str, np.ndarray], resolution: int) -> dict[str, np.ndarray]:
    """Ray Data task: one training batch's files decoded, an undecodable one replaced by a spare
    (another sample of the split, outside the batch's global step; ``spares``, a JSON list of
    ``[index, path]``) and its index with it, never by a copy of another row
    (:func:`raycl.data.stream.files.decode_batch`). The skipped files travel with the batch:
    the trial's worker names and counts them
    (:meth:`raycl.worker.stream_loader.FileStreamLoader._skip`)."""
    paths = [str(path) for path in batch["paths"][0]]
    spares = json.loads(str(batch["spares"][0])) if "spares" in batch else []
    decoded = decode_batch(paths, np.asarray(batch["index"][0], dtype=np.int64),
                           [str(path) for _, path in spares],
                           np.asarray([index for index, _ in spares], dtype=np.int64),
                           resolution)
    skips = [(name, reason or name) for name, reason in zip(decoded.skipped, decoded.reasons,
                                                            strict=True)]
    return {"images": decoded.images[None],
            "index": decoded.index[None],
            "skipped": np.array([len(skips)], dtype=np.int64),
            "skips": np.array([json.dumps(skips)], dtype=object)}


def decode_shards(
    batch: dict[str, np.ndarray], fmt: ShardFormat, resolution: int, need_captions: bool,
    tokenizer: CaptionTokenizer | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Ray Data task: the samples of some shards, decoded, in chunks
    (:func:`raycl.data.stream.shards.shard_chunks_as_columns`); with captions and a
    ``tokenizer``, each chunk also carries ``tokens``, int64 (n, L), its captions' tokens."""
    for path, count, offset in zip(batch["path"], batch["count"], batch["offset"], strict=True):
        shard = Shard(str(path), int(count), int(offset))
        for columns in shard_chunks_as_columns(shard, fmt, resolution, need_captions):
            if need_captions and tokenizer is not None:
                columns["tokens"] = tokenizer([str(text) for text in columns["caption"]])
            yield columns


__all__ = ["CaptionTokenizer", "decode_file_batch", "decode_shards"]
