#!/bin/sh
# Certificates for nats-server's client port (deploy/nats/nats-server.conf `tls {}`):
#   sh deploy/nats/make-certs.sh [DIR [HOST ...]]
# writes into DIR (deploy/nats/tls) a CA (ca.pem, ca-key.pem: keep the key offline) and a
# server certificate signed by it for the HOSTs (names or IP addresses; default: nats,
# localhost, 127.0.0.1), server.pem and server-key.pem, valid 825 days. Clients trust
# ca.pem (CDC_NATS_TLS_CA) and connect to tls://HOST:4222. Needs openssl. An existing CA in
# DIR is kept, so new server certificates stay trusted.
set -eu
dir=${1:-deploy/nats/tls}
[ "$#" -gt 0 ] && shift
[ "$#" -gt 0 ] || set -- nats localhost 127.0.0.1
mkdir -p "$dir"
umask 077
names=""
for host in "$@"; do
  case "$host" in
    *[!0-9.]*) names="$names,DNS:$host" ;;
    *) names="$names,IP:$host" ;;
  esac
done
if [ ! -f "$dir/ca.pem" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -subj "/CN=cdc_platform NATS CA" -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" 2>/dev/null
fi
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
  -keyout "$dir/server-key.pem" -out "$dir/server.csr" 2>/dev/null
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "${names#,}" > "$dir/server.ext"
openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" \
  -CAcreateserial -days 825 -extfile "$dir/server.ext" -out "$dir/server.pem" 2>/dev/null
rm -f "$dir/server.csr" "$dir/server.ext" "$dir/ca.srl"
chmod 644 "$dir/ca.pem" "$dir/server.pem"
echo "$dir: ca.pem, server.pem and server-key.pem for $*"
