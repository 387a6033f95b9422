// linkdelay: a wire with a delay, for tests/hosts/netns.py. This machine's kernel has
// no sch_netem, so a delayed link is two interfaces joined by this process:
//
//   linkdelay DEV_A DEV_B DELAY_US [LIMIT_BYTES]
//
// Every Ethernet frame received on DEV_A is sent out of DEV_B, and the other way round,
// DELAY_US microseconds after it arrived (one way: a round trip through the link gains
// twice that). Each direction is a FIFO, so frames keep their order; a direction holding
// LIMIT_BYTES (default 32 MiB) drops what arrives, as a router with a full queue does.
// Prints "ready" once both interfaces are bound (frames are forwarded from then on), or
// one line saying why not and exits 1. Stops on SIGTERM/SIGKILL or when its parent dies.
#include <arpa/inet.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <string>
#include <vector>

namespace {

// Frames are read and sent with a virtio_net_hdr in front (PACKET_VNET_HDR): a veth
// hands a packet socket TSO/GRO super-frames of up to 64 KiB, which a plain send
// refuses (EMSGSIZE, larger than the MTU). With the header they keep their GSO and
// checksum-offload metadata, and the kernel segments them where it must.
constexpr size_t kMaxFrame = 256 * 1024;
constexpr int kBatch = 64;  // frames read per socket per turn: neither side starves

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

[[noreturn]] void Fail(const std::string& what) {
  std::printf("linkdelay: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

int SetInt(int fd, int level, int name, int value) {
  return setsockopt(fd, level, name, &value, sizeof(value));
}

// A raw packet socket on `dev` that sees what arrives there, not what it sends itself.
int OpenPort(const char* dev) {
  unsigned index = if_nametoindex(dev);
  if (index == 0) Fail(std::string("no interface ") + dev);
  int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) Fail("socket(AF_PACKET)");
  if (SetInt(fd, SOL_PACKET, PACKET_VNET_HDR, 1) != 0) Fail("PACKET_VNET_HDR");
  if (SetInt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, 1) != 0) Fail("PACKET_IGNORE_OUTGOING");
  // Room for a burst while this process waits for a core; FORCE: we are root.
  SetInt(fd, SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20);
  SetInt(fd, SOL_SOCKET, SO_SNDBUFFORCE, 4 << 20);
  sockaddr_ll addr{};
  addr.sll_family = AF_PACKET;
  addr.sll_protocol = htons(ETH_P_ALL);
  addr.sll_ifindex = static_cast<int>(index);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    Fail(std::string("bind ") + dev);
  packet_mreq promisc{};  // frames for any MAC address, as a bridge port takes them
  promisc.mr_ifindex = static_cast<int>(index);
  promisc.mr_type = PACKET_MR_PROMISC;
  if (setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &promisc, sizeof(promisc)) != 0)
    Fail(std::string("promiscuous ") + dev);
  return fd;
}

struct Frame {
  int64_t due_ns;
  std::vector<char> bytes;  // virtio_net_hdr, then the Ethernet frame
};

// One direction of the link: frames read from `in`, held, then sent on `out`.
class Direction {
 public:
  Direction(int in, int out, int64_t delay_ns, size_t limit)
      : in_(in), out_(out), delay_ns_(delay_ns), limit_(limit) {}

  // Reads what has arrived (up to kBatch frames), stamping each with its due time.
  void Receive(char* buf) {
    for (int k = 0; k < kBatch; ++k) {
      ssize_t n = recv(in_, buf, kMaxFrame, MSG_TRUNC);
      if (n < 0) return;  // EAGAIN; or ENETDOWN, reported once after the link was cut
      if (static_cast<size_t>(n) > kMaxFrame || bytes_ + n > limit_) continue;  // dropped
      queue_.push_back(Frame{NowNs() + delay_ns_, std::vector<char>(buf, buf + n)});
      bytes_ += n;
    }
  }

  // Sends every frame that is due. When `out`'s send buffer is full (a tbf queue
  // behind it is backed up) the head waits for POLLOUT rather than being dropped.
  void Send(int64_t now) {
    blocked_ = false;
    while (!queue_.empty() && queue_.front().due_ns <= now) {
      Frame& f = queue_.front();
      if (send(out_, f.bytes.data(), f.bytes.size(), MSG_DONTWAIT) < 0 && errno == EAGAIN) {
        blocked_ = true;
        return;
      }
      // Sent, or refused for good (the link is cut: ENETDOWN; tbf full: ENOBUFS): gone.
      bytes_ -= f.bytes.size();
      queue_.pop_front();
    }
  }

  bool blocked() const { return blocked_; }

  // Nanoseconds until the head is due; -1 when nothing waits on time.
  int64_t WaitNs(int64_t now) const {
    if (queue_.empty() || blocked_) return -1;
    return queue_.front().due_ns > now ? queue_.front().due_ns - now : 0;
  }

 private:
  int in_, out_;
  int64_t delay_ns_;
  size_t limit_;
  size_t bytes_ = 0;
  bool blocked_ = false;
  std::deque<Frame> queue_;
};

int64_t Earliest(int64_t a, int64_t b) {
  if (a < 0) return b;
  if (b < 0) return a;
  return a < b ? a : b;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4 || argc > 5) {
    std::fprintf(stderr, "usage: linkdelay DEV_A DEV_B DELAY_US [LIMIT_BYTES]\n");
    return 2;
  }
  // Die with the harness even if it is SIGKILLed: a process left here would keep the
  // switch namespace (and its links) alive after `ip netns del`.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() == 1) return 1;
  prctl(PR_SET_TIMERSLACK, 1000UL);  // wake within ~1 us of a due time, not 50 us
  const int64_t delay_ns = std::atoll(argv[3]) * 1000;
  const size_t limit = argc == 5 ? std::strtoull(argv[4], nullptr, 10) : size_t{32} << 20;

  int a = OpenPort(argv[1]);
  int b = OpenPort(argv[2]);
  Direction ab(a, b, delay_ns, limit), ba(b, a, delay_ns, limit);
  std::printf("ready\n");
  std::fflush(stdout);

  std::vector<char> buf(kMaxFrame);
  for (;;) {
    int64_t now = NowNs();
    int64_t wait = Earliest(ab.WaitNs(now), ba.WaitNs(now));
    timespec ts{static_cast<time_t>(wait / 1000000000), static_cast<long>(wait % 1000000000)};
    pollfd fds[2] = {{a, static_cast<short>(POLLIN | (ba.blocked() ? POLLOUT : 0)), 0},
                     {b, static_cast<short>(POLLIN | (ab.blocked() ? POLLOUT : 0)), 0}};
    if (ppoll(fds, 2, wait < 0 ? nullptr : &ts, nullptr) < 0 && errno != EINTR) Fail("ppoll");
    ab.Receive(buf.data());
    ba.Receive(buf.data());
    now = NowNs();
    ab.Send(now);
    ba.Send(now);
  }
}
