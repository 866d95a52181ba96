from pathlib import Path

from setuptools import find_packages, setup

version = {}
exec((Path(__file__).parent / "encoding_syncbn" / "version.py").read_text(), version)

setup(
    name="encoding_syncbn",
    version=version["__version__"],
    description=(
        "Synchronized BatchNorm for stock torch.nn.DataParallel and torch.distributed, "
        "with In-Place Activated BatchNorm and Triton kernels"
    ),
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    author="The encoding_syncbn authors",
    project_urls={
        "In-Place ABN paper": "https://arxiv.org/abs/1712.02616",
        "Context Encoding paper (synchronised BatchNorm)": "https://arxiv.org/abs/1803.08904",
    },
    # The SPDX expression (core metadata's License-Expression) in place of a license
    # classifier, which setuptools deprecates.
    license_expression="MIT",
    license_files=["LICENSE"],
    packages=find_packages(include=["encoding_syncbn", "encoding_syncbn.*"]),
    # PEP 561: the package's type hints are visible to its users' type checkers.
    package_data={"encoding_syncbn": ["py.typed"]},
    python_requires=">=3.9",
    # 2.4: the first release with torch.library.custom_op, register_fake and register_autograd.
    # triton is optional, found at run time; numpy reads an in-place layer's small-gamma
    # flags on the host without dispatching a torch op (small_gamma.SmallGammaChannels).
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        # pytest-xdist runs the suite on every core (-n auto); torchvision, timm and smp are
        # the real models the converters are tested on (tests/test_convert_models.py); onnx,
        # onnxscript and onnxruntime run the exported models (tests/test_tracing.py);
        # lightning (which brings pytorch_lightning) fits with the plugin
        # (tests/test_lightning.py).
        "test": ["pytest", "pytest-xdist", "hypothesis", "expecttest", "ruff",
                 "triton; platform_system == 'Linux'",
                 "torchvision", "timm", "segmentation-models-pytorch",
                 "onnx", "onnxscript", "onnxruntime", "lightning"],
        "examples": ["tqdm", "matplotlib", "pillow"],
        # encoding_syncbn.lightning's SyncBatchNormPlugin; pytorch_lightning works too.
        "lightning": ["lightning"],
    },
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Environment :: GPU :: NVIDIA CUDA",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.9",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
)
