"""Delta checkpoints: the one artifact that is both AuroraRL's storage and its transfer unit.

Pure data transformation: numpy arrays and bytes in, numpy arrays and bytes out (``hf`` adds
zero-copy torch views). Modules:

* :mod:`~aurora.delta.extract` - exact changes by 16-bit pattern; fused engine names.
* :mod:`~aurora.delta.leb128` - vectorised LEB128 varints (the paper's index encoding).
* :mod:`~aurora.delta.codecs` - ``leb128``, ``aurora`` (default), ``aurora-base`` and the peers'.
* :mod:`~aurora.delta.format` - the file, segments, Merkle id, hash chain, reassembly, apply.
* :mod:`~aurora.delta.synthetic` - a synthetic Adam-like step for measurements.
* :mod:`~aurora.delta.errors` - every refusal is a :class:`~aurora.delta.errors.DeltaError`.
"""
