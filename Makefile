# Builds the static in-container init and the end-to-end test server.
#   make                                   build/rekindle-init, build/counter-server
#   make install PREFIX=/var/lib/rekindle  installs $(PREFIX)/bin/rekindle-init
#   make clean
CC ?= cc
CFLAGS ?= -O2
WARN := -Wall -Wextra -Werror
LDFLAGS ?=
PREFIX ?= /var/lib/rekindle
BUILD := build

BINS := $(BUILD)/rekindle-init $(BUILD)/counter-server

.PHONY: all install clean

all: $(BINS)

$(BUILD):
	mkdir -p $@

$(BUILD)/rekindle-init: runtime/init/rekindle-init.c | $(BUILD)
	$(CC) $(CFLAGS) $(WARN) -static $(LDFLAGS) -o $@ $<

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
	-rmdir $(BUILD) 2>/dev/null || true
