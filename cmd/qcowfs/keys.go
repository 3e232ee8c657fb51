package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/internal/keys"
	"github.com/qcowfs/qcowfs/internal/remotefile"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// Keys of encrypted images: --key-file and --key-dir, shared by mount,
// info, map and check (package keys reads and looks them up). The mount's
// daemon gets the --key-file's bytes from its parent through a pipe
// (keyFD), not by reading the file again: a key given as /dev/stdin or
// <(...) is read once, by the process the user started.

type keyFlags struct {
	KeyFile string `placeholder:"FILE" help:"The passphrase of the encrypted images (LUKS or qemu's legacy AES): the file's bytes exactly, as qemu reads a secret's file= (a trailing newline is part of the passphrase; it must be valid UTF-8 without NUL bytes). Also for every image that --key-dir gives no file. See Encrypted images in the README."`
	KeyDir  string `placeholder:"DIR" help:"A folder of passphrase files, one per encrypted image, named by the image's path relative to the source (DIR/sub/vm.qcow2 for SRC/sub/vm.qcow2; a backing file inside the source by its own path); images without one there use --key-file."`
}

// keyFD is the descriptor on which the daemon reads the --key-file's
// bytes, which its parent wrote into a pipe (fd 3 is the ready pipe).
const (
	keyFD  = 4
	keyEnv = "QCOWFS_DAEMON_KEY"
)

// loadKeys reads --key-file (in the daemon: from the parent's pipe) and
// checks --key-dir; it returns the ring (without roots yet) and the
// warnings for key files others may read. A process given keys is made
// undumpable (protectKeys).
func (k *keyFlags) loadKeys(daemon bool) (*keys.Ring, []string, error) {
	if k.KeyFile == "" && k.KeyDir == "" {
		return nil, nil, nil
	}
	protectKeys()
	var key []byte
	var warnings []string
	if k.KeyFile != "" {
		var err error
		if daemon && os.Getenv(keyEnv) != "" {
			os.Unsetenv(keyEnv)
			f := os.NewFile(keyFD, "key pipe")
			key, err = keys.Read(f, k.KeyFile)
			f.Close()
		} else {
			key, err = keys.ReadFile(k.KeyFile)
			if w := keys.ModeWarning(k.KeyFile); w != "" {
				warnings = append(warnings, w)
			}
		}
		if err != nil {
			return nil, nil, fmt.Errorf("--key-file: %w", err)
		}
	}
	if k.KeyDir != "" && !daemon {
		warnings = append(warnings, keys.DirWarnings(k.KeyDir, 5)...)
	}
	r, err := keys.New(key, k.KeyFile, k.KeyDir, nil)
	if err != nil {
		clear(key)
		return nil, nil, err
	}
	return r, warnings, nil
}

// absKeyPaths makes the key flags absolute (before the daemon leaves the
// working folder).
func (k *keyFlags) absKeyPaths() error { return makeAbs(&k.KeyFile, &k.KeyDir) }

// protectKeys keeps the process's memory, which holds keys now, out of
// core files and away from other processes of the same user: no core
// file (RLIMIT_CORE 0), and not dumpable (PR_SET_DUMPABLE 0, which also
// makes /proc/PID/mem and ptrace root's only). Failures are ignored:
// neither is needed to work.
func protectKeys() {
	unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{Cur: 0, Max: 0})
	unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0)
}

// keyRoot is the folder (or URL prefix) whose files --key-dir names by
// their path below it, for a source or an image given to info, map or
// check: the folder itself, or the one holding the file. A local one is
// resolved as the mount resolves it (fs.openLocal), so that the names
// the library gives the files lie below it.
func keyRoot(source string, resolve bool) (string, error) {
	if remote.IsURL(source) {
		if remotefile.IsPrefix(source) {
			return remote.Redact(source), nil
		}
		return remote.Redact(remotefile.Folder(source)), nil
	}
	p, err := filepath.Abs(source)
	if err != nil {
		return "", err
	}
	if resolve {
		if p, err = filepath.EvalSymlinks(p); err != nil {
			return "", err
		}
	}
	if st, err := os.Stat(p); err == nil && st.IsDir() {
		return p, nil
	}
	return filepath.Dir(p), nil
}

// keyHint says where the passphrase of the image an error names came
// from, or what would give it one; "" for an error that is not a
// qcow2.KeyError.
func keyHint(r *keys.Ring, err error) string {
	var ke *qcow2.KeyError
	if !errors.As(err, &ke) {
		return ""
	}
	h := r.Source(ke.File)
	if !ke.Missing {
		if n := r.NewlineHint(ke.File); n != "" {
			h += "; " + n
		}
	}
	return h
}

// passphrases is the qcow2 option for r (nil without keys).
func passphrases(r *keys.Ring) func(string) []byte {
	if r.Empty() {
		return nil
	}
	return r.Passphrase
}
