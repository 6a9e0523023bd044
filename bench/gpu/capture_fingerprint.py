"""Print the fingerprint of a fresh capture of a zoo model (default gpt2): run it in several
processes to check that capture is deterministic across processes (a plan made in one process
must match the model the runtime captures in another)::

    for i in 1 2 3; do python bench/gpu/capture_fingerprint.py gpt2; done | sort | uniq -c
"""

import random
import sys

from hetplan import capture, zoo

name = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
args, kwargs = zoo.example_inputs(name, batch=1)
_noise = [object() for _ in range(random.randint(0, 5000))]  # vary the allocator's state
print(capture(zoo.build(name), args, kwargs).fingerprint())
