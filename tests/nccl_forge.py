"""A rank's NCCL proxy socket hidden in /proc/net/unix behind forged lines: Python source that
the preflight tests run in a child or a pod (``os`` and ``socket`` imported first).

Sockets whose names hold a newline and then a line of /proc/net/unix naming the proxy socket's
inode with a harmless name. The table's order is its hash order; a parser that keeps the last
line per inode is fooled once a forged line comes after the real one, so random names are tried
until one does. Leaves ``keep``: the sockets to hold open, or empty when no order fooled it.
"""

FORGE_HELPERS = r"""
def names_of(ino, path="/proc/self/net/unix"):
    # The table comes a page per read, each resumed by position: sockets coming and going
    # elsewhere in the namespace meanwhile shift it (a line read twice, or not at all). So it is
    # read until two reads agree on this inode's lines.
    before = None
    for _ in range(200):
        now = []
        for line in open(path).read().splitlines()[1:]:
            f = line.split(None, 7)
            if len(f) >= 7 and f[6] == str(ino):
                now.append(f[7] if len(f) > 7 else "")
        if now == before:
            break
        before = now
    return now
def last_name(ino):
    names = names_of(ino)
    return names[-1] if names else None
"""

FORGE_PROXY_SOCKET = FORGE_HELPERS + r"""
keep = []
for attempt in range(64):
    sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sk.bind(b"\0/tmp/nccl-socket-0-%x" % (os.getpid() << 8 | attempt))
    sk.listen()
    ino = os.fstat(sk.fileno()).st_ino
    forged = "0000000000000000: 00000002 00000000 00010000 0001 01 %5d @harmless" % ino
    forgers = []
    while last_name(ino) != "@harmless" and len(forgers) < 64:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # a random name: the bucket is a checksum of the name, and names that differ only in a
        # counter's digits fall into a few neighbouring buckets (up to 16 attempts seen, some
        # runs none within 64); random ones spread over all of them
        s.bind(b"\0x" + os.urandom(16).hex().encode() + b"\n" + forged.encode())
        forgers.append(s)
    if last_name(ino) == "@harmless":
        keep = [sk, *forgers]
        break
    for s in [sk, *forgers]:
        s.close()
"""
