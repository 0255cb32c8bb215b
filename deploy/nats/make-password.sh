#!/bin/sh
# A password for a NATS user of deploy/nats/nats-server.conf, and the bcrypt hash the server
# is given in its place (no password is in the server's config or environment):
#   sh deploy/nats/make-password.sh NATS_BRIDGE_PASSWORD
# prints the password (for the client: CDC_NATS_PASSWORD, or a mirror's) and the line for
# the server's environment (deploy/.env), the hash quoted inside its value: nats-server reads
# an environment value as config, where an unquoted `$` starts a variable. Needs python3
# (3.12 or older: its crypt module) with a libc that knows bcrypt (glibc's libxcrypt does);
# `nats server passwd` (natscli) makes the same hash.
set -eu
variable=${1:?usage: make-password.sh NATS_<USER>_PASSWORD}
python3 -W ignore - "$variable" <<'PY'
import crypt, secrets, sys
password = "p" + secrets.token_urlsafe(24)  # a letter first: nats-server parses values
hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=2**11))
if not hashed or not hashed.startswith("$2"):
    sys.exit("this python's crypt cannot make bcrypt hashes: use `nats server passwd`")
print(f"password: {password}")
print(f"""{sys.argv[1]}='"{hashed.replace("$2b$", "$2a$", 1)}"'""")
PY
