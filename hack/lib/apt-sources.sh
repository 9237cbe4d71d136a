# Sourced by hack/ scripts: Debian's archive as this machine's apt already reaches it.
#
# The project names no archive host. The site serving the machine's own release (e.g. bookworm)
# is read back from apt's configured index targets, and the extra suites Rekindle needs
# (trixie: containerd 1.7.24; sid: containerd 2.1.9 and CRIU's 4.2.1 source; experimental:
# CRIU 4.3) are added from that same site, at low pin priority, with deb-src for CRIU's source.

# debian_codename: VERSION_CODENAME of the machine (or of the root in $1).
debian_codename() {
    local root=${1:-}
    (. "$root/etc/os-release" && echo "${VERSION_CODENAME:-}")
}

# debian_archive_uri: the configured site serving this machine's release "main" component.
debian_archive_uri() {
    local codename site
    codename=$(debian_codename)
    site=$(apt-get indextargets --format '$(SITE) $(RELEASE) $(COMPONENT)' 'Identifier: Packages' 2>/dev/null |
           awk -v c="$codename" '$2 == c && $3 == "main" {print $1; exit}')
    if [ -z "$site" ]; then
        echo "no configured apt source serves $codename/main; configure one first" >&2
        return 1
    fi
    printf '%s\n' "$site"
}

REKINDLE_APT_SOURCES=/etc/apt/sources.list.d/rekindle-extra.sources
REKINDLE_APT_PIN=/etc/apt/preferences.d/rekindle-pin

# write_if_changed PATH CONTENT: returns 0 when the file was (re)written.
write_if_changed() {
    if [ ! -f "$1" ] || [ "$(cat "$1")" != "$2" ]; then
        printf '%s\n' "$2" >"$1"
        return 0
    fi
    return 1
}

# ensure_extra_suites: write the extra suites' source and pin files; returns 0 when changed.
ensure_extra_suites() {
    local uri changed=1
    uri=$(debian_archive_uri) || return 2
    rm -f /etc/apt/sources.list.d/rekindle-trixie.sources  # older name of the same file
    write_if_changed "$REKINDLE_APT_SOURCES" "Types: deb deb-src
URIs: $uri
Suites: trixie sid experimental
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" && changed=0
    # Low priorities: nothing is taken from these suites unless asked for by name or version.
    write_if_changed "$REKINDLE_APT_PIN" "Package: *
Pin: release n=trixie
Pin-Priority: 100

Package: *
Pin: release n=sid
Pin-Priority: 50

Package: *
Pin: release n=experimental
Pin-Priority: 10" && changed=0
    return $changed
}
