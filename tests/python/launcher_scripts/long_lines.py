"""Each rank writes many long lines to stdout and stderr, in small unflushed pieces."""
import os
import sys

rank = int(os.environ["RANK"])
count, width = int(sys.argv[1]), int(sys.argv[2])
for i in range(count):
    for stream, name in ((sys.stdout, "out"), (sys.stderr, "err")):
        body = f"r{rank} {name} {i} " + chr(ord("a") + rank) * width
        # Several writes per line: the launcher must reassemble them.
        for k in range(0, len(body), 997):
            stream.write(body[k:k + 997])
        stream.write("\n")
