"""The language model's data: the Python standard library's own source, as bytes.

Every Python install ships it, so the app needs no download and every rank of a
job (one Python on every node) reads the same text.

* **Corpus**: the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]``
  (third-party folders ``site-packages`` and ``dist-packages`` and the
  ``__pycache__`` folders left out), sorted by their relative POSIX path.
* **Split**: a file is held out for validation when the CRC-32 of its relative
  path is ``0 mod VAL_MODULUS`` (about 10 %; fixed whatever the seed).
* **Tokens**: byte-level, ``VOCAB = 257``: the bytes ``0..255`` and ``BOS = 256``,
  which opens every document (one file is one document).
* **Packing**: documents are concatenated into one endless stream (training:
  epoch ``e`` takes the training files in the order of a permutation seeded by
  ``(seed, e)``; validation: the held-out files in sorted order); batch ``i`` of
  ``B`` sequences of ``L`` tokens takes the ``B * L + 1`` stream tokens from
  offset ``i * B * L``, row ``b`` being tokens ``[b L, b L + L + 1)`` (inputs are
  the first ``L``, targets the last ``L``).  A sequence thus holds whole and
  partial files; :func:`cu_seqlens` gives the document boundaries so attention
  never crosses them (the FlashAttention varlen convention).

Only numpy here (torch in :meth:`TokenStream.state_dict` alone): the command line
and the data are ready before torch loads.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib

import numpy as np

__all__ = ["BOS", "VOCAB", "VAL_MODULUS", "stdlib_root", "stdlib_files", "split_files", "corpus_digest",
           "TokenStream", "cu_seqlens", "flat_positions"]

#: the document-start token (bytes are 0..255)
BOS = 256
#: vocabulary size: 256 bytes + BOS
VOCAB = 257
#: a file is held out when crc32(relative path) % VAL_MODULUS == 0
VAL_MODULUS = 10
_SKIP_DIRS = frozenset(("site-packages", "dist-packages", "__pycache__"))


def stdlib_root() -> str:
    """The standard library's folder of the running Python."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative POSIX paths of the ``*.py`` files under ``root`` (default: the
    standard library), third-party and cache folders left out, sorted.

    Raises:
        FileNotFoundError: ``root`` holds no ``*.py`` file.
    """
    root = root or stdlib_root()
    out = []
    for base, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(base, f), root).replace(os.sep, "/"))
    if not out:
        raise FileNotFoundError(f"no *.py files under {root}")
    return sorted(out)


def split_files(paths: list[str]) -> tuple[list[str], list[str]]:
    """(training, validation) paths, each sorted: validation holds the paths
    whose CRC-32 is ``0 mod VAL_MODULUS``."""
    val = [p for p in paths if zlib.crc32(p.encode()) % VAL_MODULUS == 0]
    held = set(val)
    return [p for p in paths if p not in held], val


def corpus_digest(paths: list[str]) -> str:
    """SHA-256 (first 16 hex digits) of the sorted path list: two runs with the
    same digest read the same files (of the same Python version)."""
    return hashlib.sha256("\n".join(paths).encode()).hexdigest()[:16]


class TokenStream:
    """An endless stream of documents ``[BOS] + file bytes``, cut into batches.

    Args:
        root: the folder the paths are relative to.
        paths: the files (relative paths), at least one.
        seed: with ``shuffle``, epoch ``e`` reads the files in the order of
            ``numpy.random.default_rng([seed, e]).permutation``.
        shuffle: False reads the files in the given order every epoch.

    Files are read only when the stream reaches them, so a short run reads a
    few files, not the whole library.  Every rank building a stream with the
    same arguments gets the same tokens.
    """

    def __init__(self, root: str, paths: list[str], seed: int = 0, shuffle: bool = True):
        if not paths:
            raise ValueError("TokenStream needs at least one file")
        self.root, self.paths, self.seed, self.shuffle = root, list(paths), int(seed), shuffle
        self._epoch, self._order, self._next = -1, [], 0
        self._buf = np.zeros(0, dtype=np.uint16)
        self._pos = 0
        self.documents = 0  # documents read so far

    def _next_document(self) -> np.ndarray:
        if self._next >= len(self._order):
            self._epoch += 1
            n = len(self.paths)
            self._order = (np.random.default_rng([self.seed, self._epoch]).permutation(n).tolist()
                           if self.shuffle else list(range(n)))
            self._next = 0
        path = os.path.join(self.root, self.paths[self._order[self._next]])
        self._next += 1
        self.documents += 1
        with open(path, "rb") as fh:
            data = np.frombuffer(fh.read(), dtype=np.uint8)
        doc = np.empty(data.size + 1, dtype=np.uint16)
        doc[0] = BOS
        doc[1:] = data
        return doc

    def _ensure(self, n: int) -> None:
        have = self._buf.size - self._pos
        if have >= n:
            return
        parts = [self._buf[self._pos:]]
        while have < n:
            doc = self._next_document()
            parts.append(doc)
            have += doc.size
        self._buf = np.concatenate(parts)
        self._pos = 0

    def state_dict(self) -> dict:
        """The stream's position, as plain types (``torch.load(weights_only=True)``
        reads them back): a stream given it by :meth:`load_state_dict` yields
        the same batches, bit for bit, as this one from here on.

        Returns:
            dict: ``epoch`` (int, -1 before the first document), ``order``
            (list of int: this epoch's file order), ``next`` (int: index in
            ``order`` of the next file to read), ``buffer`` (``torch.int16``
            tensor: the tokens read but not yet consumed), ``documents`` (int),
            and ``seed``, ``shuffle``, ``files`` (count) and ``digest``
            (:func:`corpus_digest` of the paths), which must match the stream
            restored into.
        """
        import torch  # noqa: PLC0415  (loaded by then: only training saves a stream's state)

        rest = torch.from_numpy(self._buf[self._pos:].astype(np.int16))  # tokens <= BOS = 256
        return dict(epoch=int(self._epoch), order=[int(i) for i in self._order], next=int(self._next),
                    buffer=rest, documents=int(self.documents), seed=self.seed, shuffle=bool(self.shuffle),
                    files=len(self.paths), digest=corpus_digest(self.paths))

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (a :meth:`state_dict` of a stream over the
        same files with the same seed and shuffle).

        Raises:
            ValueError: ``state`` is of a stream over other files, another seed
                or shuffle, or is not a stream state.
        """
        try:
            epoch, order, nxt = int(state["epoch"]), [int(i) for i in state["order"]], int(state["next"])
            buf, documents = np.asarray(state["buffer"]), int(state["documents"])  # a CPU tensor reads as numpy
            mine = dict(seed=self.seed, shuffle=bool(self.shuffle), files=len(self.paths),
                        digest=corpus_digest(self.paths))
            theirs = {k: state[k] for k in mine}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a TokenStream state: {exc!r}") from None
        diff = [f"{k} {theirs[k]!r} there, {mine[k]!r} here" for k in mine if theirs[k] != mine[k]]
        if diff:
            raise ValueError("TokenStream state of another stream: " + "; ".join(diff))
        n = len(self.paths)
        if (buf.ndim != 1 or buf.dtype.kind not in "iu" or (buf.size and not 0 <= buf.min() <= buf.max() <= BOS)
                or not -1 <= epoch or not 0 <= nxt <= len(order)
                or (epoch >= 0 and sorted(order) != list(range(n))) or (epoch < 0 and (order or nxt))):
            raise ValueError("TokenStream state is inconsistent (order, next or buffer)")
        self._epoch, self._order, self._next = epoch, order, nxt
        self._buf = buf.astype(np.uint16)
        self._pos = 0
        self.documents = documents

    def batch(self, batch: int, seq_len: int) -> np.ndarray:
        """The next ``(batch, seq_len + 1)`` int64 tokens (row ``b``: stream
        tokens ``[b L, b L + L + 1)`` from the current offset, which then moves
        on by ``batch * seq_len``)."""
        n = batch * seq_len
        self._ensure(n + 1)
        flat = self._buf[self._pos:self._pos + n + 1].astype(np.int64)
        self._pos += n
        rows = np.lib.stride_tricks.sliding_window_view(flat, seq_len + 1)[::seq_len]
        return np.ascontiguousarray(rows[:batch])


def cu_seqlens(inputs: np.ndarray) -> np.ndarray:
    """Document boundaries of a batch packed as one sequence.

    Args:
        inputs: ``(B, L)`` int tokens; row ``b`` occupies the flat positions
            ``[b L, (b + 1) L)``.

    Returns:
        numpy.ndarray: int64 ``[0, ..., B * L]``, strictly increasing: every row
        start and every ``BOS`` position (a document starts there), and the end.
        Attention restricted to ``[cu[i], cu[i+1])`` segments never crosses a
        document nor a row.
    """
    B, L = inputs.shape
    starts = np.flatnonzero(inputs.reshape(-1) == BOS)
    cuts = np.union1d(np.union1d(starts, np.arange(B, dtype=np.int64) * L), [B * L])
    return cuts.astype(np.int64)


def flat_positions(batch: int, seq_len: int) -> np.ndarray:
    """Each flat token's position in its own sequence: ``arange(B L) % L`` (int64)."""
    return np.arange(batch * seq_len, dtype=np.int64) % seq_len
