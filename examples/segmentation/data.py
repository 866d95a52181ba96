"""Datasets: synthetic shapes (built in, deterministic) and Pascal VOC 2012 from disk.

Both return ``(image, mask)``: a normalised float32 ``(3, H, W)`` tensor and an int64 ``(H, W)``
tensor of class indices, with :data:`IGNORE_INDEX` for pixels that carry no label.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from PIL import Image

IGNORE_INDEX = 255

# ImageNet statistics: the usual input normalisation for ResNet backbones.
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

SHAPE_CLASSES = ("background", "circle", "square", "triangle")
#: Shapes per image (at most) and their radius range as fractions of the side, by default:
#: a few large shapes, several 8x8 feature cells across at output stride 8, so that a short
#: run's predictions follow their outlines.
DEFAULT_MAX_SHAPES = 2
DEFAULT_SHAPE_SIZE = (0.2, 0.3)
VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat",
    "chair", "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant",
    "sheep", "sofa", "train", "tvmonitor",
)


def to_tensor(image: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``(H, W, 3)`` image and ``(H, W)`` mask to the normalised tensors the model eats."""
    x = (image.astype(np.float32) / 255.0 - MEAN) / STD
    return torch.from_numpy(x.transpose(2, 0, 1).copy()), torch.from_numpy(mask.astype(np.int64))


def denormalize(image: torch.Tensor) -> np.ndarray:
    """Inverse of :func:`to_tensor` for display: ``(3, H, W)`` tensor to ``(H, W, 3)`` in [0, 1]."""
    x = image.detach().cpu().numpy().transpose(1, 2, 0) * STD + MEAN
    return np.clip(x, 0.0, 1.0)


class SyntheticShapes(Dataset):
    """Circles, squares and triangles on a textured, noisy background, with their class masks.

    Every sample is a pure function of ``(seed, split, index)``, so the dataset needs no storage,
    any worker can produce any sample, and train and val never share an image. Shapes are
    randomly coloured, sized and placed, so the class is carried by the outline only; later
    shapes may occlude earlier ones and the mask follows the painting order. Squares are
    axis-aligned and triangles point up: random rotations make the task markedly slower to
    learn, too slow for the few-minute CPU demo this dataset exists for.

    Each image holds 1 to ``max_shapes`` shapes whose radius (half the side of a square) is
    drawn uniformly from ``shape_size``, as fractions of the image side.
    """

    SPLITS = ("train", "val")

    def __init__(
        self, num_images: int, image_size: int = 64, seed: int = 0, split: str = "train",
        max_shapes: int = DEFAULT_MAX_SHAPES,
        shape_size: tuple[float, float] = DEFAULT_SHAPE_SIZE,
    ) -> None:
        if split not in self.SPLITS:
            raise ValueError(f"split must be one of {self.SPLITS}, got {split!r}")
        if image_size < 16:
            raise ValueError(f"image_size must be at least 16, got {image_size}")
        if max_shapes < 1:
            raise ValueError(f"max_shapes must be at least 1, got {max_shapes}")
        low, high = shape_size
        if not 0 < low <= high <= 1 / 3:
            # A triangle reaches 1.5 radii from its centre, which must fit inside the image.
            raise ValueError(f"shape_size must be (min, max) with 0 < min <= max <= 1/3 of the "
                             f"image side, got {tuple(shape_size)}")
        self.num_images = num_images
        self.image_size = image_size
        self.seed = seed
        self.split = split
        self.max_shapes = max_shapes
        self.shape_size = (low, high)
        self.classes = SHAPE_CLASSES

    def __len__(self) -> int:
        return self.num_images

    def render(self, index: int) -> tuple[np.ndarray, np.ndarray, list[dict]]:
        """Draw sample ``index``: uint8 image ``(H, W, 3)``, uint8 mask ``(H, W)``, and the shapes
        as dicts with ``label``, ``center`` (x, y) and ``radius``, in painting order."""
        if not 0 <= index < self.num_images:
            raise IndexError(index)
        rng = np.random.default_rng([self.seed, self.SPLITS.index(self.split), index])
        size = self.image_size
        # Pixel centres, so that areas match the continuous shapes.
        ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5

        background = rng.uniform(40, 215, size=3)
        image = np.broadcast_to(background, (size, size, 3)).astype(np.float32)
        # Texture: a colour gradient plus oriented stripes, so "flat colour" is not a shortcut.
        gradient = rng.uniform(-40, 40, size=(2, 3)) / size
        image += xs[..., None] * gradient[0] + ys[..., None] * gradient[1]
        theta, freq = rng.uniform(0, math.pi), rng.uniform(0.2, 0.8)
        stripes = np.sin(freq * (xs * math.cos(theta) + ys * math.sin(theta)) + rng.uniform(0, 6))
        image += stripes[..., None] * rng.uniform(5, 25, size=3)

        mask = np.zeros((size, size), dtype=np.uint8)
        shapes = []
        for _ in range(rng.integers(1, self.max_shapes + 1)):
            label = int(rng.integers(1, len(SHAPE_CLASSES)))
            radius = rng.uniform(*self.shape_size) * size
            cx, cy = rng.uniform(radius, size - radius, size=2)
            inside = _shape_mask(label, xs - cx, ys - cy, radius)
            # A colour clearly different from the background, or the shape would be invisible.
            color = rng.uniform(0, 255, size=3)
            while np.abs(color - background).sum() < 120:
                color = rng.uniform(0, 255, size=3)
            image[inside] = color
            mask[inside] = label
            shapes.append({"label": label, "center": (cx, cy), "radius": radius})

        image += rng.normal(0, 12, size=image.shape)
        return np.clip(image, 0, 255).astype(np.uint8), mask, shapes

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask, _ = self.render(index)
        return to_tensor(image, mask)


def _shape_mask(label: int, dx: np.ndarray, dy: np.ndarray, radius: float) -> np.ndarray:
    """Boolean mask of one shape centred at the origin of the offsets ``dx``, ``dy``."""
    name = SHAPE_CLASSES[label]
    if name == "circle":
        return dx**2 + dy**2 <= radius**2
    if name == "square":
        # Half-side ``radius``: same extent as the circle, so size does not give the class away.
        return (np.abs(dx) <= radius) & (np.abs(dy) <= radius)
    if name == "triangle":
        # Equilateral, pointing up (image y grows downwards), circumradius 1.5 * radius (about
        # the circle's area). Inside = within the inradius (half the circumradius) of the centre
        # along each edge's outward normal; each normal points away from the opposite vertex.
        inradius = 0.75 * radius
        inside = np.ones_like(dx, dtype=bool)
        for vertex_angle in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6):
            normal = vertex_angle + math.pi
            inside &= dx * math.cos(normal) + dy * math.sin(normal) <= inradius
        return inside
    raise ValueError(f"not a shape class: {label}")


class VOCSegmentation(Dataset):
    """Pascal VOC 2012 segmentation from a ``VOCdevkit/VOC2012`` folder (nothing is downloaded).

    Reads ``ImageSets/Segmentation/{split}.txt``, ``JPEGImages/<id>.jpg`` and the palette PNGs
    ``SegmentationClass/<id>.png`` (palette index = class, 255 = boundary/ignore). Training
    samples get a random scale (0.5-2x), a random ``crop_size`` crop and a horizontal flip;
    validation samples are resized so the longer side is ``crop_size`` and padded to a square,
    padding labelled :data:`IGNORE_INDEX` so it never counts.
    """

    def __init__(self, root: str | Path, split: str = "train", crop_size: int = 321) -> None:
        self.root = Path(root)
        self.split = split
        self.crop_size = crop_size
        self.train = split == "train"
        self.classes = VOC_CLASSES
        self.ids = self._check_layout()

    def _check_layout(self) -> list[str]:
        """Fail early, naming everything that is missing, instead of deep inside a DataLoader."""
        root = self.root
        hint = "--data-root must point at VOCdevkit/VOC2012"
        if not root.is_dir():
            raise FileNotFoundError(f"VOC data root {root} is not an existing folder; {hint}")
        list_file = root / "ImageSets" / "Segmentation" / f"{self.split}.txt"
        missing = [
            str(p.relative_to(root))
            for p in (root / "JPEGImages", root / "SegmentationClass", list_file)
            if not p.exists()
        ]
        if missing:
            raise FileNotFoundError(
                f"VOC data root {root} is missing {', '.join(missing)}; {hint}, the folder "
                "holding JPEGImages/, SegmentationClass/ and ImageSets/Segmentation/{train,val}.txt"
            )
        ids = [line.strip() for line in list_file.read_text().splitlines() if line.strip()]
        if not ids:
            raise ValueError(f"{list_file} lists no images")
        absent = [
            str(p) for i in ids
            for p in (root / "JPEGImages" / f"{i}.jpg", root / "SegmentationClass" / f"{i}.png")
            if not p.exists()
        ]
        if absent:
            more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
            raise FileNotFoundError(
                f"files listed in {list_file} are missing: {', '.join(absent[:3])}{more}"
            )
        return ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # PIL is only needed for real images; the synthetic path runs without it.
        from PIL import Image

        name = self.ids[index]
        image = Image.open(self.root / "JPEGImages" / f"{name}.jpg").convert("RGB")
        # Palette ("P") PNG: np.array gives the palette indices, which are the class ids.
        target = Image.open(self.root / "SegmentationClass" / f"{name}.png")
        if self.train:
            image, target = self._augment(image, target)
        else:
            scale = self.crop_size / max(image.size)
            size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            image = image.resize(size, Image.BILINEAR)
            target = target.resize(size, Image.NEAREST)
        img, mask = np.asarray(image), np.asarray(target)
        img, mask = _pad_to(img, mask, self.crop_size)
        return to_tensor(img, mask)

    def _augment(self, image: Image.Image, target: Image.Image) -> tuple[Image.Image, Image.Image]:
        """Random scale, random crop (at most ``crop_size``) and random horizontal flip."""
        from PIL import Image

        # torch's RNG: DataLoader seeds it per worker, so augmentation is reproducible.
        scale = float(torch.empty(1).uniform_(0.5, 2.0))
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.BILINEAR)
        target = target.resize(size, Image.NEAREST)
        crop = self.crop_size
        left = int(torch.randint(0, max(image.width - crop, 0) + 1, ()))
        top = int(torch.randint(0, max(image.height - crop, 0) + 1, ()))
        box = (left, top, min(left + crop, image.width), min(top + crop, image.height))
        image, target = image.crop(box), target.crop(box)
        if torch.rand(()) < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
            target = target.transpose(Image.FLIP_LEFT_RIGHT)
        return image, target


def _pad_to(image: np.ndarray, mask: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad bottom/right to ``size`` x ``size``: image with the mean colour, mask with ignore."""
    h, w = mask.shape
    if h == size and w == size:
        return image, mask
    padded = np.empty((size, size, 3), dtype=np.uint8)
    padded[:] = (MEAN * 255).astype(np.uint8)
    padded[:h, :w] = image
    padded_mask = np.full((size, size), IGNORE_INDEX, dtype=np.uint8)
    padded_mask[:h, :w] = mask
    return padded, padded_mask
