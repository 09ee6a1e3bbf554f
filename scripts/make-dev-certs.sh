#!/usr/bin/env bash
# Development certificates for kvrelay's TLS peer plane (docs/security.md): a CA, and per
# node id a certificate and key whose subject alternative names are DNS:<id> and
# URI:spiffe://kvrelay.dev/node/<id> (either can be a policy peer's "identity").
#
#   scripts/make-dev-certs.sh DIR NODE_ID...
#
# Writes DIR/ca.pem (the CA bundle), DIR/ca-key.pem, and DIR/<id>.pem + DIR/<id>-key.pem per
# node. A CA already in DIR is reused, so nodes can be added later. Environment:
#   KVRELAY_CERT_DAYS       validity of node certificates in days (default 365)
#   KVRELAY_CERT_STARTDATE  with KVRELAY_CERT_ENDDATE, explicit validity (YYYYMMDDHHMMSSZ), e.g. a
#   KVRELAY_CERT_ENDDATE    certificate that expired in 2020, for tests of refusal
# For development and tests only: production certificates come from the cluster's CA (for
# example cert-manager or SPIFFE/SPIRE), mounted where the policy's peer_tls names them.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 DIR NODE_ID..." >&2
  exit 2
fi
dir=$1
shift
mkdir -p "$dir/.ca/new"
state="$dir/.ca"
[[ -f "$state/index.txt" ]] || : >"$state/index.txt"
[[ -f "$state/serial" ]] || openssl rand -hex 16 >"$state/serial"

cat >"$state/openssl.cnf" <<CONF
[ ca ]
default_ca = dev
[ dev ]
database = $state/index.txt
new_certs_dir = $state/new
serial = $state/serial
default_md = sha256
policy = any_name
unique_subject = no
copy_extensions = none
[ any_name ]
commonName = supplied
[ node ]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = \$ENV::KVRELAY_SAN
CONF

if [[ ! -f "$dir/ca.pem" ]]; then
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 -days 3650 \
    -subj "/CN=kvrelay development CA" -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  chmod 600 "$dir/ca-key.pem"
fi

for id in "$@"; do
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$id" \
    -keyout "$dir/$id-key.pem" -out "$state/$id.csr" 2>/dev/null
  chmod 600 "$dir/$id-key.pem"
  validity=(-days "${KVRELAY_CERT_DAYS:-365}")
  if [[ -n "${KVRELAY_CERT_STARTDATE:-}" ]]; then
    validity=(-startdate "$KVRELAY_CERT_STARTDATE" -enddate "$KVRELAY_CERT_ENDDATE")
  fi
  KVRELAY_SAN="DNS:$id, URI:spiffe://kvrelay.dev/node/$id" \
    openssl ca -batch -notext -config "$state/openssl.cnf" -extensions node -cert "$dir/ca.pem" \
    -keyfile "$dir/ca-key.pem" "${validity[@]}" -in "$state/$id.csr" -out "$dir/$id.pem" 2>/dev/null
  echo "$dir/$id.pem"
done
