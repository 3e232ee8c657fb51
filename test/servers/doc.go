// Package servers starts the real servers that remote-image tests read
// from, on 127.0.0.1, each stopped when its test ends:
//
//   - StartNginx: nginx serving a folder over HTTP or HTTPS (with a CA made
//     at test time, see NewCA), its access log parsed so a test can count
//     the requests and bytes served.
//   - StartVersity: the Versity S3 Gateway (versitygw) serving a folder as
//     buckets, with an S3 client for setting up buckets and objects.
//   - NewFaultProxy: an HTTP proxy in front of either that injects faults
//     on demand: error statuses, connections dropped mid-body, stalls,
//     short bodies, a Range or If-Match header dropped, added latency.
//
// A server whose program is missing skips the test, or fails it under
// CI=true, where every tool must be installed (.ci/run installs nginx and
// versitygw). It is a normal package, not a _test one, so the remote
// package's tests and the mount tests in test/ share it.
package servers
