"""Grafts as files: extract Δ = weight·(θft − θdonor) once, share it, graft it with ``role: delta``.

``extract`` writes a delta folder, ``manifest`` reads and checks one, ``stats``
reports where a delta writes (norms, Fisher-weighted sensitivity shares).
"""
