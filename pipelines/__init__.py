"""The shared core of the detection pipeline; the DVC stages in ``stages/`` are thin layers over it.

Layers, each importing only from those below it (checked by import-linter, see ``pyproject.toml``):

* :mod:`.build`: the one edge from validated params to objects;
* :mod:`.engine`, :mod:`.evaluation`: training loop and inference/scoring;
* :mod:`.model`, :mod:`.solver`, :mod:`.checkpoint`, :mod:`.tracking`, :mod:`.distributed`;
* :mod:`.data`: datasets, annotation cache, transforms, augmentation, samplers, loaders;
* :mod:`.config`, :mod:`.compose`: params schemas and validation, ``conf/`` composition;
* :mod:`.policy`, :mod:`.cli`, :mod:`.fileio`; and :mod:`.errors` at the bottom.

Loading and validating params imports neither torch nor torchvision. No ``__init__`` re-exports
anything, so importing one module never pulls in the rest.
"""
