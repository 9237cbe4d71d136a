# Builds the static in-container init, the host-view launcher of CRIU and the end-to-end test server.
#   make                                   build/rekindle-init, build/hostexec/, build/counter-server
#   make install PREFIX=/var/lib/rekindle  installs $(PREFIX)/bin/rekindle-init
#   make clean
CC ?= cc
CFLAGS ?= -O2
WARN := -Wall -Wextra -Werror
LDFLAGS ?=
PREFIX ?= /var/lib/rekindle
BUILD := build

HOSTEXEC := $(BUILD)/hostexec
BINS := $(BUILD)/rekindle-init $(HOSTEXEC)/rekindle-hostexec $(BUILD)/counter-server

.PHONY: all install clean

all: $(BINS)

$(BUILD):
	mkdir -p $@

$(BUILD)/rekindle-init: runtime/init/rekindle-init.c | $(BUILD)
	$(CC) $(CFLAGS) $(WARN) -static $(LDFLAGS) -o $@ $<

# The launcher and its shims (links named after the programs CRIU runs by name: tar, gzip).
$(HOSTEXEC)/rekindle-hostexec: runtime/hostexec/rekindle-hostexec.c | $(BUILD)
	mkdir -p $(HOSTEXEC)/bin
	$(CC) $(CFLAGS) $(WARN) -static $(LDFLAGS) -o $@ $<
	for p in tar gzip; do ln -sfn ../rekindle-hostexec $(HOSTEXEC)/bin/$$p; done

$(BUILD)/counter-server: tests/images/counter-server.c | $(BUILD)
	$(CC) $(CFLAGS) $(WARN) -static $(LDFLAGS) -o $@ $<

# Copy to a temp name and rename: the installed binary may be executing in containers
# (writing it in place would fail with ETXTBSY or corrupt a running init).
install: $(BUILD)/rekindle-init
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 0755 $(BUILD)/rekindle-init $(DESTDIR)$(PREFIX)/bin/.rekindle-init.new
	mv -f $(DESTDIR)$(PREFIX)/bin/.rekindle-init.new $(DESTDIR)$(PREFIX)/bin/rekindle-init

clean:
	rm -f $(BINS)
	rm -rf $(HOSTEXEC)
	-rmdir $(BUILD) 2>/dev/null || true
