"""Prompts for end-to-end tests: ordinary Python code of mixed lengths."""
CODE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "    def __repr__(self):\n        return ",
    "# Copyright 2001 Python Software Foundation\n\"\"\"Utilities for reading and writing files.\"\"\"\n\n"
    "import io\nimport os\n\n__all__ = ['read', 'write']\n\n\ndef read(path, encoding='utf-8'):\n",
    "try:\n    import _thread\nexcept ImportError:\n",
    "x = {",
    "def test_basic(self):\n        self.assertEqual(",
    "with open(filename, 'rb') as f:\n        data = f.read()\n",
]
