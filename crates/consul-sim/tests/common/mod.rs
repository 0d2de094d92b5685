//! What more than one of the simulator's test binaries needs.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::AsyncBufReadExt;
use tokio::process::Child;

/// Starts the `consul-sim` binary on an ephemeral loopback port with `args`, and reads the
/// address it prints (within `within`). The child is killed when dropped.
pub(crate) async fn spawn_binary(args: &[&str], within: Duration) -> (Child, SocketAddr) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_consul-sim"))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn consul-sim");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(within, lines.next_line())
        .await
        .expect("address printed in time")
        .unwrap()
        .expect("a line");
    let addr =
        line.strip_prefix("listening on ").unwrap_or_else(|| panic!("unexpected line {line:?}")).parse().unwrap();
    (child, addr)
}
