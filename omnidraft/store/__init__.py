"""What is kept on disk: users' pairing profiles (`profiles`), the shipped presets and model loading
(`presets`, `models`) and crash-safe writes (`atomic`). Importing one module loads no other.
"""
