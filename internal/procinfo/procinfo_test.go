package procinfo

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

func TestHolds(t *testing.T) {
	// fdinfo lines as the kernel writes them (fs/locks.c, lock_get_status).
	const info = "pos:\t0\nflags:\t02100002\nmnt_id:\t27\nino:\t9984379\n" +
		"lock:\t1: OFDLCK ADVISORY  READ -1 fe:00:9984379 100 101\n" +
		"lock:\t2: OFDLCK ADVISORY  READ -1 fe:00:9984379 201 201\n" +
		"lock:\t3: -> OFDLCK ADVISORY  WRITE -1 fe:00:9984379 103 103\n" +
		"lock:\t4: POSIX  ADVISORY  WRITE 4242 fe:00:9984379 300 EOF\n"
	for _, c := range []struct {
		off  int64
		want bool
	}{{99, false}, {100, true}, {101, true}, {103, false}, {200, false}, {201, true}, {202, false}, {300, true}, {1 << 40, true}} {
		if got := holds([]byte(info), c.off); got != c.want {
			t.Errorf("holds(byte %d) = %v, want %v", c.off, got, c.want)
		}
	}
	if n := fuseConnection([]byte("pos:\t0\nflags:\t0100002\nmnt_id:\t24\nino:\t89\nfuse_connection:\t40\n")); n != 40 {
		t.Errorf("fuseConnection = %d, want 40", n)
	}
	if n := fuseConnection([]byte("pos:\t0\nflags:\t0100002\n")); n != -1 {
		t.Errorf("fuseConnection without the line = %d, want -1", n)
	}
}

// TestLockHolder: a lock taken through another open file description of
// the same file is found, with this process as its holder; the
// descriptor asked about, and bytes nobody locks, are not.
func TestLockHolder(t *testing.T) {
	p := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(p, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	asker, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer asker.Close()
	holder, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	lk := unix.Flock_t{Type: unix.F_RDLCK, Start: 101, Len: 1}
	if err := unix.FcntlFlock(holder.Fd(), unix.F_OFD_SETLK, &lk); err != nil {
		t.Fatal(err)
	}
	got, ok := LockHolder(asker, 101)
	if !ok || got.PID != os.Getpid() {
		t.Fatalf("LockHolder(byte 101) = %+v, %v; want this process", got, ok)
	}
	if s := got.String(); s != "this qcowfs (pid "+strconv.Itoa(os.Getpid())+")" {
		t.Errorf("String() = %q", s)
	}
	if got, ok := LockHolder(asker, 102); ok {
		t.Errorf("LockHolder(byte 102), which nobody locks = %+v", got)
	}
	if got, ok := LockHolder(holder, 101); ok {
		t.Errorf("LockHolder through the holding descriptor itself = %+v", got)
	}
	// Where the holder was found is remembered, and checked: once the
	// lock is gone, nobody holds it.
	lk.Type = unix.F_UNLCK
	if err := unix.FcntlFlock(holder.Fd(), unix.F_OFD_SETLK, &lk); err != nil {
		t.Fatal(err)
	}
	if got, ok := LockHolder(asker, 101); ok {
		t.Errorf("LockHolder(byte 101) after the lock was dropped = %+v", got)
	}
}

func TestString(t *testing.T) {
	for _, c := range []struct {
		p    Process
		want string
	}{
		{Process{PID: 1, Command: "qemu-system-x86_64"}, "qemu-system-x86_64 (pid 1)"},
		{Process{PID: 1, Command: "qcowfs", Mount: "/mnt/vms", FSType: "fuse.qcowfs"}, "another qcowfs (pid 1, mounted at /mnt/vms)"},
		{Process{PID: 1, Command: "qcowfs"}, "another qcowfs (pid 1)"},
		{Process{PID: 1, Command: "sshfs", Mount: "/mnt/x", FSType: "fuse.sshfs"}, "sshfs (pid 1)"},
		{Process{PID: 1}, "pid 1"},
	} {
		if got := c.p.String(); got != c.want {
			t.Errorf("%+v: %q, want %q", c.p, got, c.want)
		}
	}
}
