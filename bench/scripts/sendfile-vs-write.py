#!/usr/bin/env python3
# Sender CPU and rate of one loopback TCP connection sending a 2 GiB tmpfs file in 1 MiB
# pieces: write() from a read-only mapping (what transferd does) vs sendfile(2).
# Usage: python3 bench/scripts/sendfile-vs-write.py write sendfile write sendfile
# Writes /dev/shm/sf-test.bin (2 GiB) once; remove it afterwards.
import os, socket, mmap, resource, sys, time
N=1<<20; TOTAL=2<<30
path='/dev/shm/sf-test.bin'
if not os.path.exists(path):
    with open(path,'wb') as f:
        b=os.urandom(N)
        for i in range(TOTAL//N): f.write(b)
def recv(port):
    s=socket.socket(); s.connect(('127.0.0.1',port)); buf=bytearray(1<<20); m=memoryview(buf)
    while s.recv_into(m): pass
def run(mode):
    l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen(1); port=l.getsockname()[1]
    pid=os.fork()
    if pid==0: recv(port); os._exit(0)
    c,_=l.accept(); fd=os.open(path,os.O_RDONLY); mm=mmap.mmap(fd,0,prot=mmap.PROT_READ)
    for off in range(0,TOTAL,N): mm[off]  # touch PTEs like the store's map
    r0=resource.getrusage(resource.RUSAGE_SELF); t0=time.time()
    for off in range(0,TOTAL,N):
        if mode=='write': c.sendall(memoryview(mm)[off:off+N])
        else:
            o=off; left=N
            while left: n=os.sendfile(c.fileno(),fd,o,left); o+=n; left-=n
    c.close(); os.waitpid(pid,0); t=time.time()-t0
    r1=resource.getrusage(resource.RUSAGE_SELF)
    print(mode, 'GB/s %.2f'%(TOTAL/t/1e9), 'sender user %.3f sys %.3f CPU-s/GB'%((r1.ru_utime-r0.ru_utime)/(TOTAL/1e9),(r1.ru_stime-r0.ru_stime)/(TOTAL/1e9)))
for m in sys.argv[1:]: run(m)
