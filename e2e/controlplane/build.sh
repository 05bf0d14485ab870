#!/usr/bin/env bash
# Builds (or reuses) the binaries the e2e tests run: kube-apiserver,
# kube-controller-manager and kubectl (k8s.io/kubernetes), the node's kubelet,
# kube-scheduler and kube-proxy, CoreDNS, etcd, helm, the Prometheus server, and extracts promtool from
# Debian's prometheus package. Versions come from versions.env beside this script.
#
# Everything goes under ${XDG_CACHE_HOME:-$HOME/.cache}/shardq/, keyed by
# version: binaries in <tool>-<version>/bin, the Go module and build caches in
# go/. A tool whose bin directory is complete is not rebuilt, so a second run
# takes seconds. A cold run took 6.5 minutes on 2 cores (see e2e/README.md).
#
# Usage: e2e/controlplane/build.sh            build what is missing
#        e2e/controlplane/build.sh --print    also print KEY=path lines for the bin dirs
set -Eeuo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=versions.env
source "${here}/versions.env"

cache="${XDG_CACHE_HOME:-${HOME}/.cache}/shardq"
# Bumped when the way a tool is built changes, so old cached builds are redone.
readonly RECIPE=1

log() { printf '[build.sh %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
trap 'die "failed at line ${LINENO}: ${BASH_COMMAND}"' ERR

command -v go >/dev/null || die "go is not installed"
command -v python3 >/dev/null || die "python3 is not installed"

# The Go environment is ours alone: a user's GOFLAGS or a go.work must not leak in.
export GOTOOLCHAIN=local
export GOFLAGS=-mod=mod
export GOWORK=off
export CGO_ENABLED=0
export GOMODCACHE="${cache}/go/mod"
export GOCACHE="${cache}/go/build"
export GOPATH="${cache}/go/path"
mkdir -p "${GOMODCACHE}" "${GOCACHE}" "${GOPATH}"
# Two runs at once (a developer and CI on one machine) would share work dirs.
exec 9>"${cache}/.build.lock"
if ! flock -n 9; then
  log "another build.sh holds ${cache}/.build.lock; waiting for it"
  flock 9
fi
# Others share this machine's cores.
gobuild() { nice -n 10 go build -trimpath "$@"; }

# stamp_of NAME VERSION FILES... -> the text a complete bin dir's .complete holds
stamp_of() {
  local name="$1" version="$2"; shift 2
  printf '%s %s recipe=%s go=%s %s\n' "${name}" "${version}" "${RECIPE}" \
    "$(go env GOVERSION)" "$(cat "$@" 2>/dev/null | sha256sum | cut -c1-16)"
}

# is_complete BINDIR STAMP BINARIES...
is_complete() {
  local bindir="$1" stamp="$2"; shift 2
  [[ -f "${bindir}/.complete" && "$(cat "${bindir}/.complete")" == "${stamp}" ]] || return 1
  local b
  for b in "$@"; do [[ -x "${bindir}/${b}" ]] || return 1; done
}

# install_bindir TMPDIR BINDIR STAMP: move a finished build into place atomically.
install_bindir() {
  local tmp="$1" bindir="$2" stamp="$3"
  printf '%s' "${stamp}" >"${tmp}/.complete"
  rm -rf "${bindir}.old"
  [[ -e "${bindir}" ]] && mv "${bindir}" "${bindir}.old"
  mkdir -p "$(dirname "${bindir}")"
  mv "${tmp}" "${bindir}"
  rm -rf "${bindir}.old"
}

# expect_version BINARY EXPECTED ARGS...: the binary runs and reports EXPECTED.
expect_version() {
  local bin="$1" expected="$2"; shift 2
  local out
  out="$("${bin}" "$@" 2>&1)" || die "$(basename "${bin}") $* failed: ${out}"
  grep -qF -- "${expected}" <<<"${out}" ||
    die "$(basename "${bin}") $* reports '${out}', expected it to contain '${expected}'"
  log "  $(basename "${bin}"): $(head -n1 <<<"${out}")"
}

# prepare_k8s_module WRAPPER_GOMOD WORKDIR: a wrapper module requiring
# k8s.io/kubernetes at K8S_VERSION with every staging module replaced; sets
# K8S_LDFLAGS to the release's version stamps.
prepare_k8s_module() {
  local wrapper="$1" work="$2" version="${K8S_VERSION}"
  rm -rf "${work}" && mkdir -p "${work}"
  cp "${wrapper}" "${work}/go.mod"
  cd "${work}"

  log "kubernetes ${version}: reading the staging modules from k8s.io/kubernetes' go.mod"
  local upstream_gomod
  upstream_gomod="$(go mod download -json "k8s.io/kubernetes@${version}" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
  [[ -s "${upstream_gomod}" ]] || die "no go.mod downloaded for k8s.io/kubernetes@${version}"
  # k8s.io/kubernetes replaces each staging module (k8s.io/api, k8s.io/client-go, ...)
  # with ./staging/src/<path>; outside that repository the same code is the
  # published module at v0.<minor>.<patch>.
  local staging_version="v0.${version#v1.}"
  local edits
  edits="$(go mod edit -json "${upstream_gomod}" | python3 -c '
import json, sys
mod = json.load(sys.stdin)
staging = sorted(
    r["Old"]["Path"] for r in mod.get("Replace") or []
    if r["New"]["Path"].startswith("./staging/")
)
if not staging:
    sys.exit("no ./staging/ replace directives found")
print("-go=" + mod["Go"])
for g in mod.get("Godebug") or []:
    print("-godebug=%s=%s" % (g["Key"], g["Value"]))
for path in staging:
    print("-replace=%s=%s@%s" % (path, path, sys.argv[1]))
' "${staging_version}")"
  local -a edit_args
  mapfile -t edit_args <<<"${edits}"
  log "kubernetes ${version}: replacing $(grep -c -- '-replace=' <<<"${edits}") staging modules with ${staging_version}"
  go mod edit -require="k8s.io/kubernetes@${version}" "${edit_args[@]}"

  log "kubernetes ${version}: resolving and downloading modules (go mod tidy)"
  go mod tidy

  # The same -X flags as hack/lib/version.sh, so --version reports the release.
  local minor="${version#v1.}"; minor="${minor%%.*}"
  local build_date
  # The release's commit time, from the module proxy, keeps the build reproducible.
  build_date="$(go mod download -json "k8s.io/kubernetes@${version}" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["Info"])' |
    xargs python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["Time"])')"
  K8S_LDFLAGS="-s -w"
  local pkg key val
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    for key in gitVersion gitMajor gitMinor gitTreeState buildDate; do
      case "${key}" in
        gitVersion) val="${version}" ;;
        gitMajor) val="1" ;;
        gitMinor) val="${minor}" ;;
        gitTreeState) val="clean" ;;
        buildDate) val="${build_date}" ;;
      esac
      K8S_LDFLAGS+=" -X ${pkg}.${key}=${val}"
    done
  done
}

# build_k8s_set NAME WRAPPER COMMAND...: commands of k8s.io/kubernetes at K8S_VERSION,
# built through the wrapper module WRAPPER/go.mod into ${cache}/NAME-VERSION/bin.
# The control plane (k8s) and the real node (k8s-node) are two sets, so that
# adding node binaries left the control plane's cached build valid.
build_k8s_set() {
  local name="$1" wrapper="$2"
  shift 2
  local bins=("$@") version="${K8S_VERSION}"
  local bindir="${cache}/${name}-${version}/bin"
  local stamp
  stamp="$(stamp_of "${name}" "${version}" "${here}/${wrapper}/go.mod")"
  if is_complete "${bindir}" "${stamp}" "${bins[@]}"; then
    log "${name} ${version}: up to date in ${bindir}"
    return
  fi
  log "${name} ${version}: building ${bins[*]} (cold: minutes on 2 cores)"
  prepare_k8s_module "${here}/${wrapper}/go.mod" "${cache}/work/${name}-${version}"
  local tmp="${bindir}.tmp"
  rm -rf "${tmp}" && mkdir -p "${tmp}"
  log "${name} ${version}: compiling (nice -n 10; this is the long step)"
  gobuild -ldflags "${K8S_LDFLAGS}" -o "${tmp}/" "${bins[@]/#/k8s.io/kubernetes/cmd/}"
  local bin
  for bin in "${bins[@]}"; do
    if [[ "${bin}" == kubectl ]]; then
      expect_version "${tmp}/kubectl" "${version}" version --client
    else
      expect_version "${tmp}/${bin}" "Kubernetes ${version}" --version
    fi
  done
  install_bindir "${tmp}" "${bindir}" "${stamp}"
  log "${name} ${version}: installed into ${bindir}"
}

build_coredns() {
  local version="${COREDNS_VERSION}"
  local bindir="${cache}/coredns-${version}/bin"
  local stamp
  stamp="$(stamp_of coredns "${version}")"
  if is_complete "${bindir}" "${stamp}" coredns; then
    log "coredns ${version}: up to date in ${bindir}"
    return
  fi
  log "coredns ${version}: building (cold: several minutes on 2 cores)"
  local tmp="${bindir}.tmp"
  rm -rf "${tmp}" && mkdir -p "${tmp}"
  # CoreDNS's go.mod has no replace directives, so it installs by version directly.
  GOBIN="${tmp}" nice -n 10 go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@${version}"
  expect_version "${tmp}/coredns" "CoreDNS-${version#v}" -version
  install_bindir "${tmp}" "${bindir}" "${stamp}"
  log "coredns ${version}: installed into ${bindir}"
}

build_etcd() {
  local version="${ETCD_VERSION}"
  local bindir="${cache}/etcd-${version}/bin"
  local stamp
  stamp="$(stamp_of etcd "${version}" "${here}/etcd/go.mod")"
  if is_complete "${bindir}" "${stamp}" etcd; then
    log "etcd ${version}: up to date in ${bindir}"
    return
  fi
  log "etcd ${version}: building"
  local work="${cache}/work/etcd-${version}"
  rm -rf "${work}" && mkdir -p "${work}"
  cp "${here}/etcd/go.mod" "${work}/go.mod"
  cd "${work}"
  go mod edit -require="go.etcd.io/etcd/server/v3@${version}"
  go mod tidy
  # etcd's version number is a constant of go.etcd.io/etcd/api/v3/version (the
  # module version tidy selected); only the commit is a link-time variable, and
  # the module proxy does not tell it.
  local tmp="${bindir}.tmp"
  rm -rf "${tmp}" && mkdir -p "${tmp}"
  gobuild -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=module-${version}" \
    -o "${tmp}/etcd" go.etcd.io/etcd/server/v3
  expect_version "${tmp}/etcd" "etcd Version: ${version#v}" --version
  install_bindir "${tmp}" "${bindir}" "${stamp}"
  log "etcd ${version}: installed into ${bindir}"
}

build_helm() {
  local version="${HELM_VERSION}"
  local major="${version%%.*}"
  local bindir="${cache}/helm-${version}/bin"
  local stamp
  stamp="$(stamp_of helm "${version}")"
  if is_complete "${bindir}" "${stamp}" helm; then
    log "helm ${version}: up to date in ${bindir}"
    return
  fi
  log "helm ${version}: building"
  local helm_gomod
  helm_gomod="$(go mod download -json "helm.sh/helm/${major}@${version}" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
  # helm's Makefile stamps the Kubernetes version its client libraries speak.
  local k8s_minor
  k8s_minor="$(go mod edit -json "${helm_gomod}" | python3 -c '
import json, sys
mod = json.load(sys.stdin)
(v,) = [r["Version"] for r in mod["Require"] if r["Path"] == "k8s.io/client-go"]
print(v.split(".")[1])')"
  local p="helm.sh/helm/${major}"
  local ldflags="-s -w -X ${p}/internal/version.version=${version}"
  ldflags+=" -X ${p}/internal/version.gitTreeState=clean"
  ldflags+=" -X ${p}/pkg/lint/rules.k8sVersionMajor=1 -X ${p}/pkg/lint/rules.k8sVersionMinor=${k8s_minor}"
  ldflags+=" -X ${p}/pkg/chartutil.k8sVersionMajor=1 -X ${p}/pkg/chartutil.k8sVersionMinor=${k8s_minor}"
  local tmp="${bindir}.tmp"
  rm -rf "${tmp}" && mkdir -p "${tmp}"
  # helm's go.mod has no replace directives, so it installs by version directly.
  GOBIN="${tmp}" nice -n 10 go install -trimpath -ldflags "${ldflags}" "${p}/cmd/helm@${version}"
  expect_version "${tmp}/helm" "${version}" version --short
  install_bindir "${tmp}" "${bindir}" "${stamp}"
  log "helm ${version}: installed into ${bindir}"
}

# Upstream's server, not Debian's: Debian's prometheus package is built without
# Kubernetes service discovery ("Kubernetes support has been completely removed, due to
# the insane amount of dependencies in their client library", its NEWS.Debian), and the
# real-node test scrapes pods through kubernetes_sd_configs. The build tags keep only
# that discovery (and file/http), which spares most of the other SDs' cloud SDKs.
build_prometheus() {
  local version="${PROMETHEUS_VERSION}"
  local bindir="${cache}/prometheus-${version}/bin"
  local stamp
  stamp="$(stamp_of prometheus "${version}")"
  if is_complete "${bindir}" "${stamp}" prometheus; then
    log "prometheus ${version}: up to date in ${bindir}"
    return
  fi
  log "prometheus ${version}: building (cold: minutes on 2 cores)"
  local info release build_date
  info="$(go mod download -json "github.com/prometheus/prometheus@${version}")"
  release="$(python3 -c 'import json,sys,pathlib; print(pathlib.Path(json.load(sys.stdin)["Dir"], "VERSION").read_text().strip())' <<<"${info}")"
  build_date="$(python3 -c 'import json,sys; print(json.load(open(json.load(sys.stdin)["Info"]))["Time"])' <<<"${info}")"
  # The -X flags of upstream's .promu.yml, so `prometheus --version` names the release.
  local v="github.com/prometheus/common/version"
  local ldflags="-s -w -X ${v}.Version=${release} -X ${v}.Revision=module-${version}"
  ldflags+=" -X ${v}.Branch=HEAD -X ${v}.BuildUser=shardq-build.sh -X ${v}.BuildDate=${build_date}"
  local tmp="${bindir}.tmp"
  rm -rf "${tmp}" && mkdir -p "${tmp}"
  # Prometheus' go.mod has no replace directives at this version, so it installs by version.
  GOBIN="${tmp}" nice -n 10 go install -trimpath -tags netgo,remove_all_sd,enable_kubernetes_sd \
    -ldflags "${ldflags}" "github.com/prometheus/prometheus/cmd/prometheus@${version}"
  expect_version "${tmp}/prometheus" "prometheus, version ${release}" --version
  install_bindir "${tmp}" "${bindir}" "${stamp}"
  log "prometheus ${version}: installed into ${bindir}"
}

extract_promtool() {
  local package="${PROMTOOL_DEB_PACKAGE}"
  local bindir="${cache}/promtool-debian/bin"
  local stamp
  stamp="$(stamp_of promtool "${package}")"
  if is_complete "${bindir}" "${stamp}" promtool; then
    log "promtool: up to date in ${bindir}"
    return
  fi
  command -v apt-get >/dev/null || die "apt-get is needed to fetch Debian's ${package} package"
  # Only the .deb is downloaded and unpacked: installing the package would pull in
  # and start a Prometheus server, which the tests do not want.
  local policy
  policy="$(apt-cache policy "${package}" 2>/dev/null || true)"
  if ! grep -q 'Candidate: [0-9]' <<<"${policy}"; then
    log "promtool: apt has no candidate for ${package}; running apt-get update"
    apt-get update -qq
  fi
  local dl
  dl="$(mktemp -d)"
  chmod 755 "${dl}" # apt's _apt sandbox user must be able to write here
  log "promtool: downloading Debian package ${package}"
  (cd "${dl}" && apt-get download -qq "${package}")
  local deb
  deb="$(ls "${dl}"/"${package}"_*.deb)"
  dpkg-deb -x "${deb}" "${dl}/root"
  local tmp="${bindir}.tmp"
  rm -rf "${tmp}" && mkdir -p "${tmp}"
  cp "${dl}/root/usr/bin/promtool" "${tmp}/promtool"
  rm -rf "${dl}"
  expect_version "${tmp}/promtool" "promtool, version" --version
  install_bindir "${tmp}" "${bindir}" "${stamp}"
  log "promtool: installed into ${bindir} (from $(basename "${deb}"))"
}

started=${SECONDS}
build_etcd
build_helm
extract_promtool
build_k8s_set k8s k8s kube-apiserver kube-controller-manager kubectl
if [[ "${SHARDQ_SKIP_NODE:-}" != 1 ]]; then
  build_k8s_set k8s-node node kubelet kube-scheduler kube-proxy
  build_coredns
  # Only the real node's tests scrape with it.
  build_prometheus
fi
log "all binaries ready in ${cache} ($((SECONDS - started))s)"
if [[ "${1:-}" == "--print" ]]; then
  printf 'K8S_BIN=%s\nETCD_BIN=%s\nHELM_BIN=%s\nPROMTOOL_BIN=%s\nPROMETHEUS_BIN=%s\nNODE_BIN=%s\nCOREDNS_BIN=%s\n' \
    "${cache}/k8s-${K8S_VERSION}/bin" "${cache}/etcd-${ETCD_VERSION}/bin" \
    "${cache}/helm-${HELM_VERSION}/bin" "${cache}/promtool-debian/bin" "${cache}/prometheus-${PROMETHEUS_VERSION}/bin" \
    "${cache}/k8s-node-${K8S_VERSION}/bin" "${cache}/coredns-${COREDNS_VERSION}/bin"
fi
