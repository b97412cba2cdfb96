//! A TCP proxy on loopback that injects faults between `spillway serve`
//! and Redis: added latency, stalls (the bytes stop flowing, as when
//! packets are dropped, and flow again afterwards, as TCP retransmits
//! them), and connection resets (RST, by closing with SO_LINGER 0).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use socket2::SockRef;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// What the proxy does to the bytes it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Carries every byte at once.
    None,
    /// Holds every chunk this long, in each direction, keeping the order.
    Latency(Duration),
    /// Carries nothing, but keeps the connections open and reads what
    /// comes; when the stall ends, what was held flows on.
    Stall,
    /// Resets every open connection (RST), and every new one as soon as it
    /// is accepted, for as long as it lasts.
    Reset,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Control {
    fault: Fault,
    closing: bool,
    // Bumped by `reset_now`: connections accepted before are reset.
    generation: u64,
}

/// A proxy from a loopback port to `target`, faulty on demand. Its
/// connections are reset when it is dropped.
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    control: Arc<watch::Sender<Control>>,
}

impl FaultProxy {
    /// Listens on 127.0.0.1:`port` (0: any free port) and carries every
    /// connection to 127.0.0.1:`target`, which need not be up yet.
    pub async fn start(port: u16, target: u16) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("the proxy's port");
        let port = listener.local_addr().expect("an address").port();
        let control = Arc::new(watch::Sender::new(Control {
            fault: Fault::None,
            closing: false,
            generation: 0,
        }));
        let target: SocketAddr = ([127, 0, 0, 1], target).into();
        let accepting = control.clone();
        tokio::spawn(async move {
            let mut closing = accepting.subscribe();
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = closing.wait_for(|c| c.closing) => return,
                };
                let Ok((client, _)) = accepted else { continue };
                let control = accepting.subscribe();
                tokio::spawn(carry(client, target, control));
            }
        });
        Self { port, control }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Injects `fault` from now on (`Fault::None` ends it).
    pub fn set(&self, fault: Fault) {
        self.control.send_modify(|c| c.fault = fault);
    }

    /// Resets every open connection (RST) once; new ones are carried.
    pub fn reset_now(&self) {
        self.control.send_modify(|c| c.generation += 1);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.control.send_modify(|c| c.closing = true);
    }
}

fn reset(stream: &TcpStream) {
    // Closing with a zero linger time sends RST instead of FIN.
    let _ = SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

/// Whether a connection accepted in `generation` must be reset.
fn broken(c: &Control, generation: u64) -> bool {
    c.closing || c.fault == Fault::Reset || c.generation != generation
}

/// One connection: a reader and a writer in each direction.
async fn carry(client: TcpStream, target: SocketAddr, control: watch::Receiver<Control>) {
    let generation = control.borrow().generation;
    if broken(&control.borrow(), generation) {
        reset(&client);
        return;
    }
    let Ok(server) = TcpStream::connect(target).await else {
        reset(&client);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let (up_tx, up_rx) = mpsc::unbounded_channel();
    let (down_tx, down_rx) = mpsc::unbounded_channel();
    tokio::join!(
        read(client_read, up_tx, control.clone(), generation),
        write(up_rx, server_write, control.clone(), generation),
        read(server_read, down_tx, control.clone(), generation),
        write(down_rx, client_write, control, generation),
    );
}

/// Reads chunks and stamps each with the time it arrived. An empty chunk
/// is the end of the stream.
async fn read(
    mut from: OwnedReadHalf,
    to: mpsc::UnboundedSender<(Instant, Bytes)>,
    mut control: watch::Receiver<Control>,
    generation: u64,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            n = from.read(&mut buf) => n,
            _ = control.wait_for(|c| broken(c, generation)) => {
                reset(from.as_ref());
                return;
            }
        };
        match n {
            Ok(n) => {
                let chunk = Bytes::copy_from_slice(&buf[..n]);
                if to.send((Instant::now(), chunk)).is_err() || n == 0 {
                    return;
                }
            }
            Err(_) => {
                reset(from.as_ref());
                return;
            }
        }
    }
}

/// Writes the chunks, each no sooner than its arrival plus the latency in
/// force, none while stalled.
async fn write(
    mut chunks: mpsc::UnboundedReceiver<(Instant, Bytes)>,
    mut to: OwnedWriteHalf,
    mut control: watch::Receiver<Control>,
    generation: u64,
) {
    loop {
        let next = tokio::select! {
            next = chunks.recv() => next,
            _ = control.wait_for(|c| broken(c, generation)) => {
                reset(to.as_ref());
                return;
            }
        };
        let Some((arrived, chunk)) = next else {
            reset(to.as_ref());
            return;
        };
        // Held while stalled, and until its latency has passed.
        let sendable = loop {
            let now = *control.borrow();
            if broken(&now, generation) {
                break false;
            }
            let until = match now.fault {
                Fault::Stall => None,
                Fault::Latency(d) => Some(arrived + d),
                Fault::None | Fault::Reset => Some(arrived),
            };
            if until.is_some_and(|at| at <= Instant::now()) {
                break true;
            }
            let changed = control.changed();
            match until {
                Some(at) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at) => {}
                        c = changed => if c.is_err() { break false },
                    }
                }
                None => {
                    if changed.await.is_err() {
                        break false;
                    }
                }
            }
        };
        if !sendable {
            reset(to.as_ref());
            return;
        }
        if chunk.is_empty() {
            let _ = to.shutdown().await;
            return;
        }
        if to.write_all(&chunk).await.is_err() {
            reset(to.as_ref());
            return;
        }
    }
}
